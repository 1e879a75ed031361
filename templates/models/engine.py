"""Triton Python model `engine`: a thin adapter over inflightllm's engine.

Decoupled: `execute` validates each request and hands it, with its response sender, to
the engine loop thread, then returns at once; the loop streams the responses. Tensors
move by DLPack only (the stub's NumPy bridge corrupts data under NumPy 2).

A request carrying only `cancel_request` (a request handle) is a control request:
postprocessing sends one when a client cancels an ensemble request, which this model
cannot see itself (Triton 2.51 marks only the next step's requests cancelled).
"""

import gc
import json
import logging
import os

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.metrics import EngineMetrics
from inflightllm.model_source import ModelSpec
from inflightllm.packed_outputs import PACKED_I32
from inflightllm.parallel.placement import PlacementMetrics, instance_config, where_it_runs
from inflightllm.piece_ledger import PieceLedger
from inflightllm.sampling_params import InvalidRequestError
from inflightllm.serving.engine_io import ENGINE_INPUTS, parse_engine_request
from inflightllm.serving.engine_loop import EngineLoop, apply_switch_interval

logger = logging.getLogger("inflightllm.engine_model")


class TritonSink:
    """Sends one request's responses through its Triton response sender."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, tensors, final):
        # A DLPack capsule, not the tensor: torch's __dlpack__ protocol costs ~5 us a tensor in
        # Python, to_dlpack ~0.3 us (eleven tensors a response).
        outputs = [pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor)) for name, tensor in tensors.items()]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)

    def send_error(self, message):
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}
        # Data parallel: a KIND_GPU instance takes its own group of gpu_ids.
        config = instance_config(EngineConfig.from_parameters(params), args)
        engine = Engine(ModelSpec.from_parameters(params), config)
        self.runner = engine.runner
        place = where_it_runs(engine)  # raises if the weights are not on this instance's GPU
        logger.info("engine instance %s runs on %s", args.get("model_instance_name", ""), place)
        self.placement = PlacementMetrics(
            pb_utils, args["model_name"], args.get("model_instance_name", ""), place.get("device", "cpu")
        )
        # Finished requests' histograms on a thread of their own (inflightllm/metrics.py);
        # INFLIGHTLLM_METRICS_BACKGROUND=0 keeps them on the loop's thread (for A/B runs).
        background = os.environ.get("INFLIGHTLLM_METRICS_BACKGROUND", "1").strip() != "0"
        self.metrics = EngineMetrics(pb_utils, model_name=args["model_name"], background=background)
        # The objects built so far (torch, the model, the tokenizer's files) live as long as
        # the process: frozen, Python's garbage collector stops rescanning them in every
        # full collection that the loop's per-step allocations trigger (as vLLM does).
        gc.collect()
        gc.freeze()
        # Backpressure from postprocessing (inflightllm/piece_ledger.py): None where /dev/shm is missing.
        self.ledger = PieceLedger.create()
        apply_switch_interval()  # INFLIGHTLLM_SWITCH_INTERVAL_US, for measurements
        # Several postprocessing instances: one piece of a stream in flight keeps its pieces in order.
        ordered = int(params.get("postprocessing_instances", "1")) > 1
        self.loop = EngineLoop(engine, on_step=self._on_step, piece_ledger=self.ledger, ordered_pieces=ordered).start()
        self.metrics.update(engine.stats(), [])
        stats = engine.stats()
        logger.info("engine ready: %d KV blocks of %d tokens", stats.num_blocks_total, engine.config.block_size)

    def _on_step(self, stats, outputs):
        self.metrics.update(stats, outputs)
        self.placement.ready.set(1 if self.is_ready() else 0)

    def is_ready(self):
        """False once a tensor-parallel rank failed (Triton versions that ask the model)."""
        return getattr(self.runner, "healthy", True)

    def execute(self, requests):
        for request in requests:
            sink = TritonSink(request.get_response_sender())
            cancel = pb_utils.get_input_tensor_by_name(request, "cancel_request")
            if cancel is not None:  # a control request from postprocessing: the client cancelled
                self.loop.cancel(int(torch.from_dlpack(cancel.to_dlpack()).reshape(-1)[0]))
                sink.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            if not self.is_ready():  # a tensor-parallel rank failed: refuse at once, clearly
                self.placement.ready.set(0)
                sink.send_error(f"engine not ready: {getattr(self.runner, 'failure', None) or 'shutting down'}")
                continue
            try:
                # One pass over the request's inputs (as get_input_tensor_by_name finds them:
                # the first of a name), not one `inputs()` list per engine input.
                by_name = {}
                for tensor in request.inputs():
                    by_name.setdefault(tensor.name(), tensor)
                inputs = {}
                for name in ENGINE_INPUTS:
                    tensor = by_name.get(name)
                    if tensor is not None:
                        inputs[name] = torch.from_dlpack(tensor.to_dlpack())
                parsed = parse_engine_request(inputs)
                # The ensemble asks for the packed outputs only (inflightllm/packed_outputs.py):
                # three tensors a response instead of eleven. A client that names no outputs
                # is asked for all of them, and gets the documented ones.
                asked = request.requested_output_names()
                parsed.packed_outputs = PACKED_I32 in asked and "output_ids" not in asked
                self.loop.validate(parsed)
            except InvalidRequestError as error:
                sink.send_error(str(error))
                continue
            self.loop.submit(parsed, sink)
        return None

    def finalize(self):
        self.loop.stop()
        self.metrics.close()
        if self.ledger is not None:
            self.ledger.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:  # tensor parallel: the workers never outlive the model
            shutdown()
