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

With more than one instance (`instances.postprocessing`) the model is decoupled: it sends
each piece's response itself and only then marks the piece's ticket in its engine's
ledger; the engine sends a stream's next piece after that mark, so a stream's pieces
leave in order whichever instances decode them (inflightllm/piece_ledger.py).
"""

import json
from collections import OrderedDict

import numpy as np
import triton_python_backend_utils as pb_utils

from inflightllm.model_source import ModelSpec, load_tokenizer
from inflightllm.packed_outputs import PACKED_I32, sender, ticket
from inflightllm.piece_ledger import PieceCounter, done_slot
from inflightllm.text.postprocess import build_text_responses


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(ModelSpec.from_parameters(params))
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.engine_model = params.get("engine_model", "engine")
        self.relayed: OrderedDict[int, None] = OrderedDict()  # handles already relayed (bounded)
        self.pieces = PieceCounter(done_slot(args.get("model_instance_name", "")))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

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
        responses = [self.response(outputs) for outputs in build_text_responses(batch, self.tokenizer)]
        if not self.decoupled:  # one instance: the pieces leave in the order they came
            for inputs in batch:
                self.count_answered(inputs)
            return responses
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request, inputs, response in zip(requests, batch, responses):
            try:
                request.get_response_sender().send(response, flags=final)
            except Exception as error:  # e.g. the client went away: count it answered all the same
                pb_utils.Logger.log_error(f"postprocessing: sending a piece failed: {error}")
            self.count_answered(inputs)  # after the send: the stream's next piece may follow it now
        return None

    def count_answered(self, inputs):
        """Count a piece answered in its engine's ledger and mark its ticket (backpressure and
        order: inflightllm/piece_ledger.py)."""
        if isinstance(inputs, dict) and inputs.get(PACKED_I32) is not None:
            self.pieces.count_done(sender(inputs), 1, ticket(inputs))

    @staticmethod
    def response(outputs):
        if isinstance(outputs, Exception):  # bad ids or a bug: fail this request only
            error = outputs
            pb_utils.Logger.log_error(f"postprocessing: {type(error).__name__}: {error}")
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"postprocessing failed: {type(error).__name__}: {error}")
            )
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]
        )
