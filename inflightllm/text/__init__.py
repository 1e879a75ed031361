"""Text in and out of the engine: the logic of the `preprocessing` and `postprocessing`
Triton models (`preprocess.build_engine_request`, `postprocess.build_text_response`),
written over NumPy arrays so that it is tested without a server."""
