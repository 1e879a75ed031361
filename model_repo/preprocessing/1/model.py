"""Triton model `preprocessing`: validate and tokenize a request (a thin adapter).

The logic lives in `inflightllm.text.preprocess.build_engine_request`; this file only
converts Triton tensors to NumPy and back, and turns a `RequestError` into an error
response for that request alone (the other requests of the batch still succeed).
"""

import json

import triton_python_backend_utils as pb_utils

from inflightllm.model_source import ModelSpec, load_tokenizer, model_dims
from inflightllm.text.preprocess import (
    RequestError,
    RequestLimits,
    build_engine_request,
    check_request_parameters,
)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        spec = ModelSpec.from_parameters(params)
        self.tokenizer = load_tokenizer(spec)
        try:
            vocab_size = model_dims(spec).vocab_size
        except Exception:  # no readable config.json: the tokenizer's ids are all there is
            vocab_size = len(self.tokenizer)
        self.limits = RequestLimits.from_parameters(params, vocab_size)
        self.input_names = [tensor["name"] for tensor in config["input"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                check_request_parameters(request.parameters(), self.input_names)
                inputs = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                outputs = build_engine_request(inputs, self.tokenizer, self.limits)
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]
                    )
                )
            except RequestError as error:
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)
                    )
                )
            except Exception as error:  # a bug: fail this request, keep serving the others
                pb_utils.Logger.log_error(f"preprocessing: {type(error).__name__}: {error}")
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"preprocessing failed: {type(error).__name__}: {error}")
                    )
                )
        return responses
