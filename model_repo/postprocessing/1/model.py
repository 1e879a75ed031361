"""Triton model `postprocessing`: token ids -> text (a thin adapter).

The logic lives in `inflightllm.text.postprocess.build_text_responses`; it is stateless
(each piece carries its own detokenization context), so any instance may decode any
piece, and the pieces of one `execute` call are decoded together (one tokenizer call).
This file only converts Triton tensors to NumPy and back.

It also relays cancellations: when a client cancels an ensemble request, Triton 2.51
marks the *next* step's requests cancelled, i.e. the pieces arriving here; the engine
never sees it. A cancelled piece makes this model send the engine a control request
(`cancel_request` = the piece's `request_handle`), and the engine aborts that request
within one step and frees its KV blocks.
"""

import json
from collections import OrderedDict

import numpy as np
import triton_python_backend_utils as pb_utils

from inflightllm.model_source import ModelSpec, load_tokenizer
from inflightllm.packed_outputs import PACKED_I32, sender
from inflightllm.piece_ledger import PieceCounter
from inflightllm.text.postprocess import build_text_responses


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(ModelSpec.from_parameters(params))
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.engine_model = params.get("engine_model", "engine")
        self.relayed: OrderedDict[int, None] = OrderedDict()  # handles already relayed (bounded)
        self.pieces = PieceCounter()

    def relay_cancellation(self, request):
        handle = int(pb_utils.get_input_tensor_by_name(request, "request_handle").as_numpy().reshape(-1)[0])
        if handle in self.relayed:
            return
        self.relayed[handle] = None
        if len(self.relayed) > 4096:
            self.relayed.popitem(last=False)
        control = pb_utils.InferenceRequest(
            model_name=self.engine_model,
            requested_output_names=[],
            inputs=[pb_utils.Tensor("cancel_request", np.array([[handle]], dtype=np.int64))],
        )
        for response in control.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_error(f"postprocessing: relaying cancellation failed: {response.error().message()}")

    def execute(self, requests):
        batch = []
        for request in requests:
            if request.is_cancelled():
                # Tell the engine, then answer normally: nobody reads this response, and an
                # error response here makes Triton 2.51 count the ensemble request as in
                # flight forever (server shutdown then waits its whole exit timeout).
                self.relay_cancellation(request)
            try:
                inputs = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                batch.append(inputs)
            except Exception as error:  # fails this request only
                batch.append(error)
        # Count the answered pieces in their engine's ledger (backpressure: inflightllm/piece_ledger.py).
        for inputs in batch:
            if isinstance(inputs, dict) and inputs.get(PACKED_I32) is not None:
                self.pieces.count_done(sender(inputs))
        responses = []
        for outputs in build_text_responses(batch, self.tokenizer):
            if isinstance(outputs, Exception):  # bad ids or a bug: fail this request only
                error = outputs
                pb_utils.Logger.log_error(f"postprocessing: {type(error).__name__}: {error}")
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"postprocessing failed: {type(error).__name__}: {error}")
                    )
                )
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]
                )
            )
        return responses
