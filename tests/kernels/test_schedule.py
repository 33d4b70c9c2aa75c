"""The KV loop of the v2 kernels keeps tiles in flight on Hopper; v1's does not.

Captures the Triton IR that Pallas emits for each kernel at Llama-3-8B shapes (cross-lowered
for an abstract H200) and compiles it for sm_90 with upstream Triton 3.9
(``jaxpaged.benchmarks.kernels.schedule_check``). XLA bundles its own Triton and compiles the
custom call with that one, so this checks the kernel's structure (what Triton's pipeliner can
overlap, and the registers and shared memory it needs), not the final GPU schedule, which only a GPU
run shows.
"""

import platform
import sys

import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import DECODE_TILE, DECODE_WARPS_FP8, PROGRAMS_PER_SM
from jaxpaged.benchmarks.kernels.decode_paper_model import speed_ratio
from jaxpaged.benchmarks.kernels.schedule_check import (kernel_facts, loop_instructions,
                                                        loop_opcodes, shared_wavefronts)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("upstream triton (the test extra) is installed on linux x86_64 only",
                allow_module_level=True)


def passes(facts, min_programs):
    """The issue-19 criteria: >= 2 tile buffers, an async_wait leaving copies in flight, and
    at least ``min_programs`` programs per SM."""
    return facts.pipelined and facts.programs_per_sm >= min_programs


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_v2_decode_keeps_tiles_in_flight_with_4_programs_per_sm(kv_dtype):
    facts = kernel_facts("v2", "decode", kv_dtype)
    print("v2 decode", jnp.dtype(kv_dtype).name, facts.describe())
    assert facts.tile_buffers >= 2
    assert max(facts.async_waits) > 0
    assert facts.programs_per_sm >= PROGRAMS_PER_SM
    assert facts.stack == 0                                 # no register spills
    assert passes(facts, PROGRAMS_PER_SM)


@pytest.mark.parametrize("group", [1, 4, 5, 8])
def test_v2_prefill_keeps_tiles_in_flight_without_spills(group):
    """Every G up to Llama-3-70B's 8 (issue 41 item 4): a 32-token block at G >= 5 is 160+
    rows, which spilled 144 bytes a thread at 32-key tiles and 16 warps; its programs now
    take 16 tokens each (``prefill_split``), 128 rows like G = 4's."""
    facts = kernel_facts("v2", "prefill", group=group)
    print("v2 prefill G", group, facts.describe())
    assert facts.tile_buffers >= 2
    assert max(facts.async_waits) > 0
    assert facts.programs_per_sm >= 1
    assert facts.stack == 0


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_v1_fails_the_same_check(mode):
    """v1 loads the page id inside the iteration that uses it: every iteration waits for
    its own loads (async_wait num 0), whatever num_stages is."""
    facts = kernel_facts("v1", mode)
    print("v1", mode, facts.describe())
    assert all(n == 0 for n in facts.async_waits)
    assert not passes(facts, PROGRAMS_PER_SM)


def test_loop_instructions_reads_the_longest_backward_branch():
    sass = "\n".join(f"        /*{a:04x}*/                   {op} ;" for a, op in [
        (0x00, "MOV R1, c[0x0][0x28]"), (0x10, "@!P0 BRA 0x60"), (0x20, "FADD R2, R2, R3"),
        (0x30, "MUFU.EX2 R4, R2"), (0x40, "@P0 BRA 0x20"), (0x50, "BRA 0x10"),
        (0x60, "EXIT")])
    assert loop_instructions(sass) == 5         # 0x10 .. 0x50, the longest loop
    assert loop_instructions("        /*0000*/                   EXIT ;") == 0


def test_loop_opcodes_and_shared_wavefronts():
    sass = "\n".join(f"        /*{a:04x}*/                   {op} ;" for a, op in [
        (0x00, "LDS.U8 R1, [R2]"), (0x10, "@P0 LDS.U8 R3, [R2+0x10]"),
        (0x20, "@!PT LDS RZ, [RZ]"), (0x30, "LDSM.16.MT88.4 R4, [R5]"),
        (0x40, "STS.128 [R6], R8"), (0x50, "LDGSTS.E.64 [R7], desc[UR4][R8.64], P0"),
        (0x60, "HMMA.16816.F32 R8, R4, R6, R8"), (0x70, "@!P1 BRA 0x0"), (0x80, "EXIT")])
    ops = loop_opcodes(sass)
    assert ops == {"LDS.U8": 2, "LDSM.16.MT88.4": 1, "STS.128": 1, "LDGSTS.E.64": 1,
                   "HMMA.16816.F32": 1, "BRA": 1}          # the @!PT filler left out
    assert shared_wavefronts(ops) == 2 + 4 + 4 + 2


@pytest.mark.parametrize("mode,limit", [("decode", 300), ("prefill", 600)])
def test_v2_loops_stay_within_their_instruction_budgets(mode, limit):
    """Issue 41: with scores in base 2 and ``exp2`` (``pallas_kernels.attention_tiles``) the
    bf16 KV loops compiled for sm_90 are 280 (decode, 32-key tiles) and 561 (prefill)
    instructions; with ``exp`` they were 326 and 836. A loop growing past the budget fails."""
    facts = kernel_facts("v2", mode)
    print("v2", mode, facts.describe())
    assert 0 < facts.loop_instructions <= limit


def test_v2_merge_reads_its_slots_together_without_spills():
    """Issue 41 item 3: the split-K merge's loop handles MERGE_SLOTS (8) slots an iteration
    in 326 instructions (41 a slot; one slot at a time it was 62), 56 registers, no stack."""
    from pallas_kernels.paged_attention import MERGE_SLOTS

    facts = kernel_facts("v2", "merge")
    print("v2 merge", facts.describe())
    assert facts.stack == 0 and facts.registers <= 64
    assert 0 < facts.loop_instructions <= 45 * MERGE_SLOTS


def test_v2_fp8_decode_loop_reads_words_and_computes_in_float16():
    """Issue 41 item 1: an fp8 pool's tiles convert to f16 pairs (one F2FP.F16.E4M3 for two
    values) and multiply in f16 (568 -> 476 instructions through bf16), and are widened
    through 32-bit words (``pallas_kernels.fp8_words``): the tiles leave shared memory in
    16-byte loads instead of byte loads (32 LDS.U8) and ~76 register moves: 476 -> 270
    instructions a 32-key tile at 4 warps (bf16: 280). With 2 warps (``DECODE_WARPS_FP8``)
    a warp's loop is 421 instructions, 105 warp instructions a KiB of K/V (4 warps: 135;
    before: 238), 128 registers, 6 programs an SM. On paper (``decode_paper_model``) fp8
    decode goes from issue-bound (0.94x bf16 at half the peak issue rate) to bound by
    shared memory at 1.83x."""
    facts = kernel_facts("v2", "decode", jnp.float8_e4m3fn)
    print("v2 decode fp8", facts.describe())
    assert facts.num_warps == DECODE_WARPS_FP8 == 2
    assert 0 < facts.loop_instructions <= 440 and facts.stack == 0
    assert facts.warp_instructions_per_kv_kib <= 110
    assert facts.programs_per_sm >= 6
    assert facts.opcode_count("LDS.U8") == 0 and facts.opcode_count("IMAD.MOV") <= 16
    assert facts.opcode_count("F2FP.F16.E4M3") == 64       # 2 x 32 x 128 values / 64 / 2
    bf16 = kernel_facts("v2", "decode")
    for efficiency in (1.0, 0.5):
        ratio = speed_ratio(facts, bf16, fast_keys=DECODE_TILE, base_keys=DECODE_TILE,
                            issue_efficiency=efficiency)
        print(f"fp8/bf16 on paper, issue at {efficiency:.0%}: {ratio:.2f}x")
        assert ratio >= 1.75
