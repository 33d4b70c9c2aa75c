"""What a Pallas kernel's loop compiles to on Hopper, read on a machine without a GPU.

Cross-lowering (``pallas_kernels.lowering``) proves that a kernel becomes a Triton custom
call; it does not show whether the KV loop keeps loads in flight. This module shows that on
CPU (``shared/JAX_FACTS.md`` section 7):

1. :func:`capture_ttir` lowers a function for an abstract H200 and keeps the Triton IR
   (TTIR) that Pallas emits for each ``pallas_call``, by wrapping the private
   ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` (checked on jax 0.11.2
   and 0.12.0.1; :class:`ScheduleCheckUnavailable` names it if it moves).
2. :func:`compile_for_hopper` compiles a TTIR with upstream ``triton`` (3.9.0 from PyPI,
   which ships ptxas and cuobjdump and needs no GPU) for sm_90.
3. :func:`schedule_facts` reads what decides the schedule: the number of shared-memory
   buffers of the KV tiles (``!ttg.memdesc<N x tile x D>``: N >= 2 is multi-buffering), the
   ``ttg.async_wait {num = K}`` counts in the loop (K > 0: copies stay in flight across
   iterations; 0: every iteration waits for its own loads), registers per thread
   (cuobjdump), shared memory (``metadata.shared``), the programs that fit on one SM, and
   the main loop's SASS: its length, opcodes (``LDS.U8`` byte loads, ``IMAD.MOV`` moves...)
   and shared-memory wavefronts, which ``decode_paper_model`` turns into cycles a tile.

XLA compiles the custom call with its own bundled Triton, not this one, so these facts
describe the kernel's structure (what the pipeliner can overlap), not the final GPU schedule.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile
import warnings

import jax

from pallas_kernels.lowering import lower_for_cuda

#: Hopper (H100/H200) per-SM limits: 32-bit registers, shared memory (bytes), resident
#: blocks and warps; shared memory the driver reserves per block.
SM90_REGISTERS = 65536
SM90_SHARED = 228 * 1024
SM90_MAX_BLOCKS = 32
SM90_MAX_WARPS = 64
SM90_RESERVED_SHARED = 1024


class ScheduleCheckUnavailable(RuntimeError):
    """The private jax hook or the triton package this check relies on is missing."""


@dataclasses.dataclass(frozen=True)
class CapturedKernel:
    """One ``pallas_call``'s Triton IR. name: the kernel's function name; ttir: its text."""

    name: str
    ttir: str


def capture_ttir(fn, *args, **kwargs) -> list[CapturedKernel]:
    """Lower ``fn(*args, **kwargs)`` for an H200 and return every Pallas kernel's TTIR, in
    lowering order.

    Raises:
        ScheduleCheckUnavailable: this jax has no
            ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module``.
    """
    try:
        from jax._src.pallas.triton import lowering as triton_lowering
        original = triton_lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        raise ScheduleCheckUnavailable(
            f"jax {jax.__version__} has no jax._src.pallas.triton.lowering."
            f"lower_jaxpr_to_triton_module (private API, present in jax 0.11.2 and 0.12.0.1); "
            f"the schedule check needs it to see the Triton IR") from e
    captured: list[CapturedKernel] = []

    def capturing(*a, **kw):
        result = original(*a, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        name = re.search(r"tt\.func (?:public )?@([\w$.]+)", text).group(1)
        captured.append(CapturedKernel(name, text))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = capturing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
            lower_for_cuda(fn, *args, **kwargs)
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    return captured


def compile_for_hopper(ttir: str, *, num_warps: int, num_stages: int):
    """Compile TTIR text for sm_90 with upstream Triton; returns its ``CompiledKernel``
    (``asm["ttgir"]``, ``asm["ptx"]``, ``asm["cubin"]``, ``metadata.shared``).

    Raises:
        ScheduleCheckUnavailable: ``triton`` is not installed.
    """
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise ScheduleCheckUnavailable("the schedule check needs `pip install triton==3.9.0` "
                                       "(the test extra on linux x86_64)") from e
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        return triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})


@dataclasses.dataclass(frozen=True)
class ScheduleFacts:
    """What the compiled KV loop looks like.

    Attributes:
        tile_buffers: shared-memory buffers per KV tile (max N of ``memdesc<N x tile x D>``;
            0 when the tiles are not staged through shared memory at all).
        async_waits: the ``num`` of every ``ttg.async_wait`` in the kernel.
        registers: registers per thread (cuobjdump's REG).
        stack: stack frame per thread in bytes (cuobjdump's STACK; register spills go there).
        shared: shared memory per program in bytes.
        num_warps: warps per program.
        loop_instructions: SASS instructions of the KV loop's body (the kernel's longest
            backward branch; cuobjdump), one tile an iteration.
        tile_kv_bytes: bytes of K and V one iteration loads (tile keys x head_dim x 2 x
            the pool's item size).
        loop_opcodes: (opcode, count) of the loop's SASS instructions, most frequent first
            (predicates dropped; never-executed ``@!PT`` fillers left out).
    """

    tile_buffers: int
    async_waits: tuple[int, ...]
    registers: int
    stack: int
    shared: int
    num_warps: int
    loop_instructions: int = 0
    tile_kv_bytes: int = 0
    loop_opcodes: tuple[tuple[str, int], ...] = ()

    def opcode_count(self, prefix: str) -> int:
        """Loop instructions whose opcode starts with ``prefix`` (``"LDS.U8"``, ``"HMMA"``)."""
        return sum(n for op, n in self.loop_opcodes if op.startswith(prefix))

    @property
    def shared_wavefronts(self) -> int:
        """128-byte shared-memory wavefronts one warp's loop iteration issues
        (:func:`shared_wavefronts`): at one a cycle per SM, the shared-memory time."""
        return shared_wavefronts(dict(self.loop_opcodes))

    @property
    def instructions_per_kv_kib(self) -> float:
        """Loop instructions a KiB of K and V costs (per program: what decides whether a
        memory-bound kernel can issue fast enough to keep up with HBM)."""
        return self.loop_instructions * 1024 / max(self.tile_kv_bytes, 1)

    @property
    def warp_instructions_per_kv_kib(self) -> float:
        """Loop instructions of all the program's warps a KiB of K and V: the SM's issue
        work per byte, comparable across warp counts."""
        return self.instructions_per_kv_kib * self.num_warps

    @property
    def programs_per_sm(self) -> int:
        """Resident programs per Hopper SM: the least of the register, shared-memory, block
        and warp limits (registers allocated per warp in units of 256)."""
        per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = SM90_REGISTERS // (per_warp * self.num_warps)
        by_shared = SM90_SHARED // (self.shared + SM90_RESERVED_SHARED)
        return min(by_registers, by_shared, SM90_MAX_BLOCKS, SM90_MAX_WARPS // self.num_warps)

    @property
    def pipelined(self) -> bool:
        """At least two tile buffers and a wait that leaves copies in flight."""
        return self.tile_buffers >= 2 and any(n > 0 for n in self.async_waits)

    def describe(self) -> str:
        """One line for logs and notes."""
        return (f"buffers={self.tile_buffers} async_wait nums={list(self.async_waits)} "
                f"registers={self.registers} stack={self.stack} B shared={self.shared} B "
                f"programs/SM={self.programs_per_sm} loop={self.loop_instructions} "
                f"instructions ({self.instructions_per_kv_kib:.0f} per KiB of K/V), "
                f"{self.shared_wavefronts} shared wavefronts a warp")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump ``flag``'s output for ``cubin`` (Triton's bundled copy, else one on PATH)."""
    from triton.backends.nvidia import compiler as nvidia
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool if os.path.exists(tool) else "cuobjdump", flag, path],
                              capture_output=True, text=True, check=True).stdout


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread from cuobjdump."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


def _loop_body(sass: str) -> list[str]:
    """The instructions from the target of the kernel's longest backward branch to the
    branch (its main loop; empty without one), in cuobjdump ``-sass`` text."""
    at = {int(a, 16): text for a, text in
          re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, flags=re.M)}
    loops = [(int(target, 16), address) for address, text in at.items()
             for target in re.findall(r"\bBRA\s+0x([0-9a-f]+)", text)
             if int(target, 16) < address]
    if not loops:
        return []
    low, high = max(loops, key=lambda span: span[1] - span[0])
    return [text for a, text in sorted(at.items()) if low <= a <= high]


def loop_instructions(sass: str) -> int:
    """SASS instructions of the kernel's main loop (:func:`_loop_body`; 0 without one)."""
    return len(_loop_body(sass))


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode -> count over the main loop, predicates dropped; ``@!PT`` instructions (never
    executed, scheduling fillers) are left out."""
    ops = collections.Counter()
    for text in _loop_body(sass):
        if not text.startswith("@!PT"):
            ops[re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]] += 1
    return ops


def shared_wavefronts(opcodes) -> int:
    """128-byte shared-memory wavefronts of one warp's instructions ``{opcode: count}``
    (an SM serves one a cycle): ``LDSM``/``STSM`` x4, x2, x1 and ``LDS``/``STS``/``LDGSTS``
    of 128, 64 or up to 32 bits a thread take 4, 2 and 1. Bank conflicts would add more;
    this is the floor."""
    total = 0
    for op, n in opcodes.items():
        if re.match(r"(LDSM|STSM)\.", op):
            total += n * int(op.rsplit(".", 1)[1])
        elif re.match(r"(LDS|STS|LDGSTS)(\.|$)", op):
            width = re.search(r"\.(128|64)\b", op)
            total += n * (int(width.group(1)) // 32 if width else 1)
    return total


def schedule_facts(compiled, *, tile_keys: int, head_dim: int,
                   kv_itemsize: int = 2) -> ScheduleFacts:
    """Read :class:`ScheduleFacts` off a :func:`compile_for_hopper` result whose KV tiles
    are ``tile_keys x head_dim`` (K and V; the transposed K buffer counts too) of
    ``kv_itemsize``-byte elements."""
    ttgir = compiled.asm["ttgir"]
    shapes = {(tile_keys, head_dim), (head_dim, tile_keys)}
    buffers = [int(n) for n, a, b in re.findall(r"!ttg\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir)
               if (int(a), int(b)) in shapes]
    single = re.search(rf"!ttg\.memdesc<({tile_keys}x{head_dim}|{head_dim}x{tile_keys})x",
                       ttgir)
    waits = tuple(int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+) : i32\}",
                                             ttgir))
    registers, stack = _cubin_resources(compiled.asm["cubin"])
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    return ScheduleFacts(tile_buffers=max(buffers, default=1 if single else 0),
                         async_waits=waits, registers=registers, stack=stack,
                         shared=int(compiled.metadata.shared),
                         num_warps=int(compiled.metadata.num_warps),
                         loop_instructions=loop_instructions(sass),
                         tile_kv_bytes=2 * tile_keys * head_dim * kv_itemsize,
                         loop_opcodes=tuple(loop_opcodes(sass).most_common()))


# ---- the paged-attention kernels at Llama-3-8B shapes ----------------------------------------

#: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, page 16), batch 64 at
#: context 4096: the shapes of the check.
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, batch=64,
                 context=4096, pool_pages=8192)


def kernel_facts(kernel: str, mode: str, kv_dtype=None,
                 group: int | None = None) -> ScheduleFacts:
    """:class:`ScheduleFacts` of a paged-attention kernel at :data:`LLAMA3_8B` shapes, bf16.

    Args:
        kernel: ``"v2"`` (``pallas_kernels.paged_attention`` / ``prefill_attention``) or
            ``"v1"`` (``pallas_kernels.paged_attention_v1``).
        mode: ``"decode"`` (one token per sequence), ``"prefill"`` (v2: 32-token prefill
            blocks; v1: its 16-token query blocks of a mixed step) or ``"merge"`` (v2: the
            split-K merge of one sequence decoding at 8192 tokens, 64 split slots; its
            "tiles" are :data:`~pallas_kernels.paged_attention.MERGE_SLOTS` slots of one
            row each, so buffers and bytes per tile mean little).
        kv_dtype: the pool's dtype (default bfloat16; float8_e4m3fn for an fp8 pool).
        group: query heads per KV head, G (default Llama-3-8B's 4; Llama-3-70B's is 8):
            ``group x 8`` query heads over the 8 KV heads.
    """
    import functools

    import jax.numpy as jnp

    from pallas_kernels import paged_attention, paged_attention_v1, prefill_attention

    s = LLAMA3_8B
    sds = jax.ShapeDtypeStruct
    d, qh, kvh, b = s["head_dim"], s["num_heads"], s["num_kv_heads"], s["batch"]
    qh = qh if group is None else group * kvh
    pool = sds((s["pool_pages"], s["page_size"], kvh, d), kv_dtype or jnp.bfloat16)
    table = sds((b, s["context"] // s["page_size"]), jnp.int32)
    ints = lambda *shape: sds(shape, jnp.int32)
    scale = dict(scale=d ** -0.5, interpret=False)
    if kernel == "v2" and mode == "decode":
        fn = functools.partial(paged_attention.paged_decode_attention, **scale)
        args = (sds((b, qh, d), jnp.bfloat16), pool, pool, table, ints(b), ints(b), ints(1))
        tile, warps, stages = (paged_attention.DECODE_TILE,
                               paged_attention.decode_warps(pool.dtype),
                               paged_attention.DECODE_STAGES)
    elif kernel == "v2" and mode == "prefill":
        block_q = 32
        fn = functools.partial(prefill_attention.paged_prefill_attention, **scale)
        args = (sds((b, block_q, qh, d), jnp.bfloat16), pool, pool, table, ints(b),
                ints(b, block_q))
        split = prefill_attention.prefill_split(block_q, qh // kvh)
        tile, warps = prefill_attention.prefill_launch(
            prefill_attention.program_rows(block_q // split, qh // kvh))
        stages = prefill_attention.PREFILL_STAGES
    elif kernel == "v2" and mode == "merge":
        fn = functools.partial(paged_attention.paged_decode_attention, **scale)
        table = sds((1, 8192 // s["page_size"]), jnp.int32)
        args = (sds((1, qh, d), jnp.bfloat16), pool, pool, table, ints(1), ints(1), ints(1))
        merge = [k for k in capture_ttir(fn, *args) if "merge" in k.name][0]
        compiled = compile_for_hopper(merge.ttir, num_warps=4, num_stages=2)
        return schedule_facts(compiled, tile_keys=paged_attention.MERGE_SLOTS, head_dim=d,
                              kv_itemsize=4)
    elif kernel == "v1":
        block_q = 1 if mode == "decode" else 16
        fn = functools.partial(paged_attention_v1.paged_attention, **scale)
        args = (sds((b, block_q, qh, d), jnp.bfloat16), pool, pool, table, ints(b),
                ints(b, block_q))
        tile, warps, stages = s["page_size"], 4, 2          # v1's page tiles and defaults
    else:
        raise ValueError(f"unknown kernel {kernel!r} or mode {mode!r}")
    attention = capture_ttir(fn, *args)[0]                  # the first launch; v2 decode's
    compiled = compile_for_hopper(attention.ttir, num_warps=warps, num_stages=stages)
    return schedule_facts(compiled, tile_keys=tile, head_dim=d,
                          kv_itemsize=jnp.dtype(pool.dtype).itemsize)


def main(argv=None) -> int:
    """``python -m jaxpaged.benchmarks.kernels.schedule_check``: print each kernel's facts and a
    verdict against issue 19's criteria (>= 2 tile buffers, an async_wait with num > 0, and for
    decode >= 4 programs per SM). Exit status 0 whatever the verdicts (a report, not a test)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m jaxpaged.benchmarks.kernels.schedule_check",
        description="Compile the v1 and v2 paged-attention kernels (Llama-3-8B shapes, bf16) "
                    "for sm_90 with upstream triton and report their KV-loop schedule. XLA "
                    "compiles with its own bundled Triton: this shows the kernels' structure, "
                    "not the final GPU schedule.")
    parser.add_argument("--kernel", nargs="+", choices=("v1", "v2"), default=["v1", "v2"])
    parser.add_argument("--mode", nargs="+", choices=("decode", "prefill"),
                        default=["decode", "prefill"])
    parser.add_argument("--fp8", action="store_true",
                        help="also v2 decode over a float8_e4m3fn pool, with the paper model's "
                             "fp8/bf16 speed ratio (jaxpaged.benchmarks.kernels."
                             "decode_paper_model)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    rows = [(kernel, mode, None) for kernel in args.kernel for mode in args.mode]
    if args.fp8:
        rows.append(("v2", "decode", "float8_e4m3fn"))
    seen = {}
    for kernel, mode, kv_dtype in rows:
        facts = seen[kernel, mode, kv_dtype] = kernel_facts(kernel, mode, kv_dtype)
        need = 4 if mode == "decode" else 1
        ok = facts.pipelined and facts.programs_per_sm >= need
        verdict = "pipelined" if ok else "NOT pipelined" if not facts.pipelined else (
            f"fewer than {need} programs/SM")
        print(f"{kernel} {mode}{' ' + kv_dtype if kv_dtype else ''}: {facts.describe()} "
              f"-> {verdict}")
    if args.fp8:
        from jaxpaged.benchmarks.kernels import decode_paper_model
        from pallas_kernels.paged_attention import DECODE_TILE

        bf16 = seen.get(("v2", "decode", None)) or kernel_facts("v2", "decode")
        for line in decode_paper_model.report(seen["v2", "decode", "float8_e4m3fn"], bf16,
                                              keys=DECODE_TILE):
            print("paper model (H200):", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
