"""Sequence groups on a GPU (docs/SEQUENCE-GROUPS.md): CudaPagedAttention.copy_blocks, the
copy-on-write of shared blocks in one gather/scatter over the whole cache; n=4 seeded
outputs equal to each run alone; beam search equal to `transformers` on the same GPU and
weights (fp32). Written without a GPU at hand: run with
    PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu/test_sequence_groups_gpu.py -x -q
"""

from __future__ import annotations

import pytest
import torch

from inflightllm.sampling_params import SamplingParams
from inflightllm.sequence_group import GroupParams
from tests.gpu.test_gpu_engine import Reference, gpu_config, make_prompts, model_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_every_layer_and_nothing_else(dtype):
    from inflightllm.attention.cuda import CudaPagedAttention

    backend = CudaPagedAttention(4, 2, 64, None, max_model_len=1024)
    backend.allocate_kv_cache(16, 16, 3, 2, 64, dtype, "cuda")
    backend.kv_cache.copy_(torch.randn(backend.kv_cache.shape, device="cuda"))  # [layers, 2, blocks, ...]
    before = backend.kv_cache.clone()
    copies = [(1, 5), (7, 2), (3, 11)]
    backend.copy_blocks(copies)
    torch.cuda.synchronize()
    after = backend.kv_cache
    for source, destination in copies:
        assert torch.equal(after[:, :, destination], before[:, :, source])
    untouched = [block for block in range(16) if block not in {d for _, d in copies}]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])
    backend.copy_blocks([])  # nothing to copy: no launch, no error


@pytest.fixture(scope="module")
def engine():
    from inflightllm.engine import Engine

    return Engine(model_spec("float32"), gpu_config(), sampler_seed=0)


def generate(engine, request_id, prompt, params, group=None) -> dict[int, list[int]]:
    engine.add_request(request_id, prompt, params, group=group)
    outputs: dict[int, list[int]] = {}
    finals = []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            outputs.setdefault(output.sequence_index, []).extend(output.new_token_ids)
            if output.finished:
                finals.append(output)
    return outputs, finals


def test_n4_seeded_outputs_equal_each_alone_and_share_the_prompt(engine):
    prompt = make_prompts(1, engine.vocab_size, seed=3)[0] * 3  # a few blocks long
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=21, ignore_eos=True)
    copies_before = engine.stats().num_cow_copies_total
    together, _ = generate(engine, "group", prompt, params, GroupParams(n=4))
    if (len(prompt) - 1) % engine.config.block_size:
        assert engine.stats().num_cow_copies_total - copies_before == 3  # the partial prompt block
    for index in range(4):
        alone, _ = generate(engine, f"alone-{index}", prompt,
                            SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=21 + index,
                                           ignore_eos=True))
        assert together[index] == alone[0], index
    assert engine.block_manager.num_used_blocks == 0


def transformers_beams(reference, engine, prompt: list[int], width: int) -> tuple[list[list[int]], list[float]]:
    """`transformers` beam search of 10 tokens on the same weights (length_penalty 1,
    early_stopping False): every returned beam's generated ids up to its EOS, and the scores."""
    eos = sorted(engine.loaded.eos_token_ids)
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=reference.model.device)
        out = reference.model.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
            do_sample=False, max_new_tokens=10, length_penalty=1.0, early_stopping=False, output_scores=True,
            return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos[0])
    expected = []
    for sequence in out.sequences.tolist():
        generated = sequence[len(prompt):]
        expected.append(generated[: next((i for i, t in enumerate(generated) if t in eos), len(generated))])
    return expected, out.sequences_scores.tolist()


@pytest.mark.parametrize("beam_width", [2, 4, 8])
def test_beams_equal_transformers(engine, beam_width):
    reference = Reference(engine)
    prompt = make_prompts(2, engine.vocab_size, seed=5)[1]
    group = GroupParams(beam_width=beam_width, length_penalty=1.0, early_stopping=False)
    _, [final] = generate(engine, f"beams-{beam_width}", prompt, SamplingParams(max_tokens=10), group)
    expected, scores = transformers_beams(reference, engine, prompt, beam_width)
    assert final.beam_token_ids == expected
    assert final.beam_scores == pytest.approx(scores, abs=1e-3)
    assert engine.block_manager.num_used_blocks == 0


class RecordingRunner:
    """The engine's runner, keeping each launched step's beam updates."""

    def __init__(self, runner):
        self.runner = runner
        self.beam_updates: list[tuple[str, str, int]] = []
        self.sent_whole: list[str] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, step):
        self.beam_updates.extend(step.beam_updates)
        self.sent_whole.extend(new.request_id for new in step.new_requests)
        return self.runner.launch(step)


def test_beam_groups_together_move_rows_and_equal_transformers(engine):
    """Three beam groups at once beside a greedy request (asynchronous scheduling): one
    batched beam step a step for all of them; forks and reassigned beams reach the runner as
    row copies (`beam_updates`, `GpuModelRunner._apply_beam_updates`), copied-on-write
    tables as new tables; each group's beams equal transformers' for its prompt alone."""
    reference = Reference(engine)
    prompts = make_prompts(4, engine.vocab_size, seed=11)
    widths = [2, 4, 8]
    recorder = RecordingRunner(engine.runner)
    engine.runner = recorder
    try:
        for width, prompt in zip(widths, prompts, strict=False):
            engine.add_request(f"together-{width}", prompt, SamplingParams(max_tokens=10),
                               group=GroupParams(beam_width=width))
        engine.add_request("greedy-beside", prompts[3], SamplingParams(max_tokens=24, ignore_eos=True))
        finals = {}
        while engine.has_unfinished():
            for output in engine.step():
                assert output.error is None, output.error
                if output.finished:
                    finals[output.request_id] = output
    finally:
        engine.runner = recorder.runner
    assert any(target != source for target, source, _ in recorder.beam_updates), "no beam moved"
    # Sent whole: each group's first sequence and the beams of its first step; nothing after.
    beam_sent = [request_id for request_id in recorder.sent_whole if request_id.startswith("together-")]
    assert len(beam_sent) == sum(widths), beam_sent
    for width, prompt in zip(widths, prompts, strict=False):
        expected, scores = transformers_beams(reference, engine, prompt, width)
        final = finals[f"together-{width}"]
        assert final.beam_token_ids == expected, width
        assert final.beam_scores == pytest.approx(scores, abs=1e-3), width
    assert engine.block_manager.num_used_blocks == 0
