"""Every CUDA module must compile for every GPU the engine runs on (compute capability 8.0 and
later: inflightllm.gpu.model.MIN_CAPABILITY), because CuPy compiles a whole module for the GPU
at hand: one instruction that ptxas refuses below sm_89 made layers.cu, and with it the engine
of every dtype, fail on an A100. CI has no GPU and no nvcc, so this reads the sources: inline PTX
that needs sm_89 (FP8 conversions and mma) or sm_90 (PDL, TMA bulk copies, mbarrier transactions) must
sit in the `#if` branch of an `__CUDA_ARCH__ >=` guard at least that high, or in SM90_ASM
(gpu/pdl.cuh: the asm on sm_90+, a trap below)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "inflightllm"
SOURCES = sorted(p for p in ROOT.rglob("*") if p.suffix in (".cu", ".cuh"))
# PTX and the lowest architecture (x 10) that has it
NEEDS = (
    (re.compile(r"\b(cvt\.[a-z0-9.]*e[45]m[23]x2)"), 890),
    (re.compile(r"\b(mma\.[a-z0-9.]*\.e[45]m[23])"), 890),
    (re.compile(r"\bgriddepcontrol\b"), 900),
    (re.compile(r"\bcp\.async\.bulk\b"), 900),
    (re.compile(r"\bmbarrier\.(try_wait|arrive\.expect_tx|init)\b"), 900),
    (re.compile(r"\bfence\.(proxy\.async|mbarrier_init)\b"), 900),
    (re.compile(r"\b(wgmma|setmaxnreg|stmatrix)\b"), 900),
)
GUARD = re.compile(r"^\s*#\s*if\b.*__CUDA_ARCH__\s*>=\s*(\d+)")


def unguarded(text: str) -> list[tuple[int, str, int]]:
    """(line number, instruction, architecture it needs) of each PTX instruction in `text` that
    is not under a high enough `__CUDA_ARCH__ >=` guard nor inside an SM90_ASM(...) call."""
    stack: list[list] = []  # [guarded architecture or 0, in the #else branch]
    in_sm90_call = False
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if re.match(r"#\s*if", stripped):
            match = GUARD.match(line)
            stack.append([int(match.group(1)) if match else 0, False])
            continue
        if re.match(r"#\s*(else|elif)", stripped):
            if stack:
                stack[-1][1] = True
            continue
        if re.match(r"#\s*endif", stripped):
            if stack:
                stack.pop()
            continue
        if stripped.startswith("//") or stripped.startswith("#"):
            continue
        if "SM90_ASM(" in line:
            in_sm90_call = True
        guard = max([arch for arch, in_else in stack if not in_else] + [900 if in_sm90_call else 0])
        code = line.split("//", 1)[0] if '"' not in line.split("//", 1)[0] else line
        for pattern, needs in NEEDS:
            match = pattern.search(code)
            if match and guard < needs:
                found.append((number, match.group(0), needs))
        if in_sm90_call and ");" in line:
            in_sm90_call = False
    return found


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_arch_specific_ptx_is_guarded(source):
    found = unguarded(source.read_text())
    assert not found, "\n".join(f"{source.name}:{n}: {instr} needs sm_{arch // 10} but is not guarded"
                                for n, instr, arch in found)


def test_the_check_finds_what_broke_the_a100():
    """The code layers.cu had: the e4m3 conversion as bare inline PTX (and PDL's wait unguarded,
    a TMA copy outside SM90_ASM); the guarded and SM90_ASM forms pass."""
    broken = '''
__device__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
}
__device__ void wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ void copy() { asm volatile("cp.async.bulk.shared::cluster.global [%0], [%1], 16, [%2];" ::); }
#else
__device__ void convert() { asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(x)); }
#endif
'''
    assert [(n, arch) for n, _, arch in unguarded(broken)] == [(4, 890), (7, 900), (9, 900), (11, 890)]
    fixed = '''
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#endif
    SM90_ASM("{\\n .reg .pred p;\\n WAIT_%=:\\n"
             " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\\n"
             " @!p bra WAIT_%=;\\n}\\n" ::"r"(bar), "r"(parity) : "memory");
'''
    assert unguarded(fixed) == []
