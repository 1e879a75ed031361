"""Fault injection for tests through the real server (`fault_injection: true`, tests only).

With the engine setting `fault_injection` on, a request carrying one of these seeds fails
on purpose in the runner, so a test can check that it fails alone:
- `SAMPLING_FAULT_SEED`: its sampling fails (the runner reports it in `SampledTokens.failed`);
- `STEP_FAULT_SEED`: the whole model step that holds it raises.
Every other request is untouched. Off (the default), this module is never imported.
"""

from __future__ import annotations

from inflightllm.step import SampledTokens, StepDescription

SAMPLING_FAULT_SEED = 7_000_000_001
STEP_FAULT_SEED = 7_000_000_002


class InjectedFault(RuntimeError):
    """A fault raised on purpose."""


class FaultInjectingRunner:
    """Wraps a runner (`execute(step) -> SampledTokens`) and injects the faults above."""

    def __init__(self, runner):
        self.runner = runner
        self._seeds: dict[str, int | None] = {}

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step: StepDescription) -> SampledTokens:
        for new in step.new_requests:
            self._seeds[new.request_id] = new.params.seed
        for request_id in step.finished_request_ids:
            self._seeds.pop(request_id, None)
        sampled = self.runner.execute(step)
        if any(self._seeds.get(request_id) == STEP_FAULT_SEED for request_id, _ in step.scheduled):
            # After the runner ran (its state moved on, as after a real late failure): the
            # engine fails this step's requests and tells the runner they finished.
            raise InjectedFault("injected model step fault")
        keep = [row for row, request_id in enumerate(sampled.request_ids)
                if self._seeds.get(request_id) != SAMPLING_FAULT_SEED]
        if len(keep) == len(sampled.request_ids):
            return sampled
        for row, request_id in enumerate(sampled.request_ids):
            if row not in keep:
                sampled.failed[request_id] = "sampling failed: InjectedFault: injected sampling fault"
        return SampledTokens(
            request_ids=[sampled.request_ids[row] for row in keep],
            token_ids=[sampled.token_ids[row] for row in keep],
            logprobs=[sampled.logprobs[row] for row in keep],
            top_ids=[sampled.top_ids[row] for row in keep],
            top_logprobs=[sampled.top_logprobs[row] for row in keep],
            failed=sampled.failed,
        )
