"""Triton model `postprocessing`: token ids -> text (a thin adapter).

The logic lives in `inflightllm.text.postprocess.build_text_response`; it is stateless
(each piece carries its own detokenization context), so any instance may decode any
piece. This file only converts Triton tensors to NumPy and back.
"""

import json

import triton_python_backend_utils as pb_utils

from inflightllm.model_source import ModelSpec, load_tokenizer
from inflightllm.text.postprocess import build_text_response


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(ModelSpec.from_parameters(params))
        self.input_names = [tensor["name"] for tensor in config["input"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                outputs = build_text_response(inputs, self.tokenizer)
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]
                    )
                )
            except Exception as error:  # bad ids or a bug: fail this request only
                pb_utils.Logger.log_error(f"postprocessing: {type(error).__name__}: {error}")
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"postprocessing failed: {type(error).__name__}: {error}")
                    )
                )
        return responses
