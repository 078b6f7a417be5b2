"""Compiling with NVRTC (no GPU needed): cubins per arch, resource reports, compile errors."""

import functools
import pickle
import struct

import pytest

from attngen.arch import get_arch
from attngen.compiler import (Binary, Resources, cache_options, compile, compile_options, cubin_resources,
                               nvrtc_version, parse_resources, performance_notes)
from attngen.errors import AttngenError, CompileError
from attngen.render import render
from attngen.spec import parse_spec, resolve

ALL_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
EM_CUDA = 190

# Two specs an arch: one common to all, one that rotates so every head dim, both dtypes and
# every mask reach NVRTC somewhere. Kept small: each compile is about half a second.
COMMON = "prefill:head_dim=128,dtype=bf16,mask=causal"
ROTATING = {
    "sm_80": "prefill:head_dim=64",
    "sm_86": "prefill:head_dim=96,dtype=fp16,mask=sliding_window,return_lse=true",
    "sm_89": "prefill:head_dim=192,dtype=bf16,mask=causal,return_lse=true",
    "sm_90": "prefill:head_dim=256",
    "sm_90a": "prefill:head_dim=64,dtype=fp16,mask=causal,return_lse=true",
    "sm_100": "prefill:head_dim=96,dtype=bf16,mask=none",
    "sm_120": "prefill:head_dim=256,dtype=fp16,mask=sliding_window",
}
CASES = [(a, COMMON) for a in ALL_ARCHS] + list((a, t) for a, t in ROTATING.items())


@functools.lru_cache(maxsize=None)
def built(text: str, arch: str):
    spec = resolve(parse_spec(text), arch)
    source = render(spec)
    return spec, source, compile(source, arch, kernel_name=spec.kernel_name)


def assert_no_ptxas_notes(b: Binary) -> None:
    """No coded ptxas note in a build's log (setmaxnreg ignored, wgmma serialised or waited for); skips where
    NVRTC's log held no ptxas report to look in."""
    if not b.resources.known:
        pytest.skip("NVRTC's log held no ptxas report")
    assert not performance_notes(b.log)


def _elf_sm(cubin: bytes) -> int:
    """The SM number a CUDA ELF is built for, from its e_flags."""
    (e_flags,) = struct.unpack_from("<I", cubin, 48)
    return (e_flags >> 8) & 0xFF if cubin[8] >= 8 else e_flags & 0xFF


@pytest.mark.parametrize("arch, text", CASES, ids=[f"{a}-{t.split(':')[1]}" for a, t in CASES])
def test_compiles_a_cubin_for_the_exact_arch(arch, text):
    spec, source, b = built(text, arch)
    a = get_arch(arch)
    assert isinstance(b, Binary)
    assert b.cubin[:4] == b"\x7fELF"
    assert b.cubin[4] == 2  # 64-bit
    assert struct.unpack_from("<H", b.cubin, 18)[0] == EM_CUDA
    assert _elf_sm(b.cubin) == a.major * 10 + a.minor
    assert spec.kernel_name.encode() in b.cubin  # the extern "C" symbol, unmangled
    assert b.kernel_name == spec.kernel_name
    assert b.arch == a.name
    assert b.options == compile_options(a)
    assert b.nvrtc_version == nvrtc_version()
    assert f"Compiling entry function '{spec.kernel_name}' for '{a.name}'" in b.log
    assert b.compile_seconds > 0
    assert b.ptx == ""  # not asked for
    r = b.resources
    assert 0 < r.registers <= a.max_regs_per_thread
    assert r.registers * spec.threads <= a.regs_per_sm, "a block could never be resident"
    assert r.smem_static + spec.smem_bytes() <= a.smem_per_block
    assert pickle.loads(pickle.dumps(b)) == b
    # the whole image: the program and section header tables end inside it, the former at its last byte
    phoff, shoff = struct.unpack_from("<QQ", b.cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", b.cubin, 0x36)
    assert len(b.cubin) == max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def test_performance_notes_are_ptxas_coded_lines_once_each():
    line = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
            "stage in the function 'k' in line 0")
    log = "\n".join([line, "ptxas info    : 118 bytes gmem", line, "ptxas info    : Used 245 registers, used 16 barriers",
                     "ptxas info    : Compiling entry function 'k_merge' for 'sm_90a'"])
    assert performance_notes(log) == ("C7514: Potential Performance Loss: wgmma.mma_async instructions are serialized "
                                      "due to non wgmma instructions reading accumulator registers of  a wgmma between "
                                      "start and end of the pipeline stage in the function 'k' in line N (2 places)",)
    # NVRTC 12.9's form on some sm_90a kernels: one note a source line, counted as one
    arrive = "ptxas info    : (C7519) warpgroup.arrive is injected in around line {} by compiler to allow use of " \
             "registers in GMMA in function 'k'"
    assert performance_notes("\n".join(arrive.format(n) for n in (1772, 2127, 3334)) + "\n" + line) == (
        "C7519: warpgroup.arrive is injected in around line N by compiler to allow use of registers in GMMA in "
        "function 'k' (3 places)",
        "C7514: Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions "
        "reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'k' in "
        "line N")
    assert performance_notes("ptxas info    : Function properties for k (none)\n") == ()
    assert performance_notes("") == ()


@pytest.mark.parametrize("text", [
    "prefill:head_dim=64", "prefill:head_dim=128,mask=causal,return_lse=true",
    "prefill:head_dim=256,cta_tile_q=128,cta_tile_kv=80,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma,"
    "schedule=pingpong,persistent=false",
    "prefill:head_dim=64,cta_tile_q=192,cta_tile_kv=128,num_warps=12,num_stages=2,mma=wgmma,pipeline=tma,"
    "schedule=pingpong,persistent=false",
    "prefill:head_dim=128,cta_tile_q=128,cta_tile_kv=128,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma,"
    "schedule=overlap,persistent=false",
])
def test_overlapped_kernels_keep_their_wgmma_pipelined(text):
    # ptxas says so when it waits for or serialises wgmma to protect accumulator registers (C7514-C7517): O's
    # rescale between S = Q K^T's issue and P V's once made it wait for S in every turn (C7517), and branches
    # around the commits serialised every wgmma (C7514)
    spec, _, b = built(text, "sm_90a")
    assert spec.overlapped
    assert_no_ptxas_notes(b)


@pytest.mark.parametrize("text", [
    "mla_decode:q_rows=64,qk_shard=alternate,cta_tile_kv=64,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma",
    "mla_decode:q_rows=64,paged=true,qk_shard=alternate,cta_tile_kv=64,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma",
    "mla_decode:q_rows=64,qk_shard=true,cta_tile_kv=64,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma",
])
def test_mla_wgmma_kernels_keep_their_wgmma_pipelined(text):
    # The same ptxas notes for MLA's wgmma kernels: in the alternate-tile loop, a wait<0> for P V inside a branch
    # that ptxas could not pair with the branch issuing it serialised every wgmma of the kernel (C7514), with no
    # other sign (registers and spills as before)
    assert_no_ptxas_notes(built(text, "sm_90a")[2])


@pytest.mark.parametrize("kv,schedule", [(80, "serial"), (64, "serial"), (96, "pingpong")])
def test_one_cta_tma_kernels_keep_setmaxnreg(kv, schedule):
    # The whole-row TMA kernel says how many CTAs an SM holds (launch bounds): without it ptxas could not tell the
    # register count at entry for these head_dim 64 tiles, ignored setmaxnreg (C7508) and serialised every wgmma of
    # the serial schedule (C7519); they ran 1.11-1.22x faster once it could (H100, 2026-11-27)
    _, _, b = built(f"prefill:head_dim=64,cta_tile_q=128,cta_tile_kv={kv},num_warps=8,num_stages=2,mma=wgmma,"
                    f"pipeline=tma,schedule={schedule},persistent=false", "sm_90a")
    assert_no_ptxas_notes(b)


@pytest.mark.parametrize("text", ["prefill:head_dim=64", "prefill:head_dim=128,mask=causal,sinks=true",
                                  "prefill:head_dim=192,head_dim_v=128,dtype=fp16", "prefill:head_dim=256,softcap=true"])
def test_paged_tma_defaults_fit_the_producer_warps_registers(text):
    # A paged cache's key tiles are copied in boxes that the producer warpgroup's four warps share, in the registers
    # setmaxnreg leaves them (24, or 32 beside three consumer warpgroups): the defaults build spill-free and with no
    # ptxas note (a loop over every other column block kept a counter that spilled 4 bytes at 192/128)
    spec, _, b = built(text + ",varlen=true,paged=true", "sm_90a")
    assert spec.pipeline.value == "tma" and spec.paged
    r = b.resources
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (spec.to_text(full=True), r)
    assert_no_ptxas_notes(b)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_tunings_do_not_spill(arch, head_dim):
    text = COMMON if head_dim == 128 else f"prefill:head_dim={head_dim}"
    spec, _, b = built(text, arch)
    assert spec.head_dim == head_dim
    r = b.resources
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (spec.to_text(full=True), r, b.log)


@pytest.mark.parametrize("arch, text", [
    ("sm_80", "prefill:head_dim=128,mask=causal,custom_mask=true"),  # the main entry beside its plan entries
    ("sm_90a", "decode:head_dim=128,q_rows=16"),  # beside its merge entry
    ("sm_120", "mla_decode:q_rows=64"),
    # a config that spills (24-byte stack frame, NVRTC 13.5): the frame, which every spill needs, is in the cubin
    ("sm_90a", "prefill:head_dim=128,cta_tile_q=128,cta_tile_kv=160,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma,"
               "schedule=pingpong,persistent=true"),
])
def test_cubin_resources_agree_with_the_ptxas_report(arch, text):
    # What the cubin says of an entry (registers, stack frame) is what ptxas reported for it
    spec, _, b = built(text, arch)
    r, c = b.resources, cubin_resources(b.cubin, spec.kernel_name)
    if not r.known:  # (NVRTC 13.0 on the lent H100s left the report out of every log of one such run)
        pytest.skip("NVRTC's log held no ptxas report to compare with")
    assert not c.known
    assert (c.registers, c.stack_frame) == (r.registers, r.stack_frame) and c.registers > 0, (r, c)
    assert (c.stack_frame > 0) == (r.spill_stores > 0)
    assert cubin_resources(b.cubin, "no_such_entry") == Resources(known=False)
    assert cubin_resources(b.cubin[:100], spec.kernel_name) == Resources(known=False)


def test_a_log_without_the_report_takes_registers_from_the_cubin(monkeypatch):
    # NVRTC leaves ptxas' report out of some program logs (NVRTC 13.0 on the lent H100s, for many kernels): the
    # registers and the stack frame then come from the cubin, and the spill counts are marked unknown
    import attngen.compiler as compiler

    spec, source, want = built(COMMON, "sm_90a")
    real = compiler._run_nvrtc
    monkeypatch.setattr(compiler, "_run_nvrtc", lambda *a: (lambda c, log, p: (c, "", p))(*real(*a)))
    got = compile(source, "sm_90a", kernel_name=spec.kernel_name).resources
    assert got == Resources(registers=want.resources.registers, stack_frame=0, known=False)


def test_sm90_and_sm90a_are_separate_targets():
    _, _, plain = built(COMMON, "sm_90")
    _, _, specific = built(COMMON, "sm_90a")
    assert "for 'sm_90a'" in specific.log and "for 'sm_90'" in plain.log
    assert plain.options != specific.options


@pytest.mark.parametrize("arch, instr", [("sm_90", "mma.sync.aligned.m16n8k16"),
                                         ("sm_90a", "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16")])
def test_ptx_on_request(arch, instr):
    # sm_90a's default prefill is the wgmma kernel; plain sm_90 (and every other arch) mma.sync
    spec = resolve(parse_spec("prefill:head_dim=64"), arch)
    b = compile(render(spec), arch, kernel_name=spec.kernel_name, want_ptx=True)
    assert f".entry {spec.kernel_name}(" in b.ptx
    assert f".target {arch}" in b.ptx
    assert instr in b.ptx
    assert "\x00" not in b.ptx


def _inject(source: str, piece: str, offset: int, code: str) -> tuple[str, int]:
    """Insert ``code`` ``offset`` lines into the bracketed ``piece``; returns (source, 1-based line)."""
    lines = source.splitlines()
    i = lines.index(f"// attngen:begin {piece}")
    assert f"// attngen:end {piece}" not in lines[i:i + offset + 1]
    lines.insert(i + offset, code)
    return "\n".join(lines) + "\n", i + offset + 1


def test_broken_source_raises_compile_error_with_log_lines_and_piece():
    spec = resolve(parse_spec("prefill:head_dim=64"), "sm_80")
    source, line = _inject(render(spec), "prefill/mask.cuh", 4, "int attngen_broken = undefined_symbol_xyz;")
    with pytest.raises(CompileError) as ei:
        compile(source, "sm_80", kernel_name=spec.kernel_name)
    e = ei.value
    assert isinstance(e, AttngenError)
    text = str(e)
    assert e.log and 'identifier "undefined_symbol_xyz" is undefined' in e.log
    assert "NVRTC log:" in text and e.log.strip() in text
    assert e.error_lines() == [line]
    assert f"--- around line {line} (from prefill/mask.cuh) ---" in text
    assert f">>{line:6d} | int attngen_broken = undefined_symbol_xyz;" in text
    # Context lines are numbered too, without the marker.
    assert f"  {line - 1:6d} | " in text and f"  {line + 1:6d} | " in text
    assert text.count(">>") == 1
    assert "--gpu-architecture=sm_80" in text
    assert e.source == source and e.name == spec.kernel_name
    assert e.options == compile_options(get_arch("sm_80"))


def test_errors_in_two_pieces_each_get_their_origin():
    spec = resolve(parse_spec("prefill:head_dim=128,mask=causal"), "sm_90")
    source, l1 = _inject(render(spec), "common/ptx.cuh", 3, "static_assert(false, \"one\");")
    source, l2 = _inject(source, "common/smem_tile.cuh", 2, "this is not cuda;")
    with pytest.raises(CompileError) as ei:
        compile(source, "sm_90", kernel_name=spec.kernel_name)
    text = str(ei.value)
    assert ei.value.error_lines()[:2] == [l1, l2]
    assert f"--- around line {l1} (from common/ptx.cuh) ---" in text
    assert f"--- around line {l2} (from common/smem_tile.cuh) ---" in text
    assert f">>{l1:6d} | " in text and f">>{l2:6d} | " in text


def test_errors_in_a_nested_piece_and_after_it_name_the_innermost():
    # prefill_fwd's step of a KV tile is a piece of its own, rendered inside prefill_fwd once a loop: an error in
    # it names it, and one just after it names prefill_fwd again.
    spec = resolve(parse_spec("prefill:head_dim=64"), "sm_80")
    source, l1 = _inject(render(spec), "prefill/step.cuh.jinja", 2, "int attngen_broken = undefined_one;")
    lines = source.splitlines()
    after = lines.index("// attngen:end prefill/step.cuh.jinja") + 1
    lines.insert(after, "int attngen_broken_too = undefined_two;")
    with pytest.raises(CompileError) as ei:
        compile("\n".join(lines) + "\n", "sm_80", kernel_name=spec.kernel_name)
    text = str(ei.value)
    assert f"--- around line {l1} (from prefill/step.cuh.jinja) ---" in text
    assert f"--- around line {after + 1} (from prefill/fwd.cuh.jinja) ---" in text


def test_error_in_the_family_template_names_no_piece():
    spec = resolve(parse_spec("prefill:head_dim=64"), "sm_80")
    lines = render(spec).splitlines()
    i = lines.index("namespace attngen {", lines.index("// attngen:end prefill/fwd.cuh.jinja"))
    lines.insert(i + 1, "constexpr int BAD = ;")
    with pytest.raises(CompileError) as ei:
        compile("\n".join(lines) + "\n", "sm_80", kernel_name=spec.kernel_name)
    text = str(ei.value)
    assert f"--- around line {i + 2} ---" in text
    assert f">>{i + 2:6d} | constexpr int BAD = ;" in text


def test_missing_header_is_a_compile_error():
    src = '#include "attngen_no_such_header.cuh"\nextern "C" __global__ void k() {}\n'
    with pytest.raises(CompileError) as ei:
        compile(src, "sm_80", kernel_name="k")
    assert "attngen_no_such_header.cuh" in str(ei.value)
    assert ei.value.error_lines() == [1]
    assert ">>     1 | #include" in str(ei.value)


def test_source_without_the_named_entry_raises():
    spec = resolve(parse_spec("prefill:head_dim=64"), "sm_80")
    with pytest.raises(CompileError) as ei:
        compile(render(spec), "sm_80", kernel_name=spec.kernel_name[:-1])  # a prefix is not the name
    assert f"no entry function named {spec.kernel_name[:-1]}" in str(ei.value)
    with pytest.raises(CompileError, match="no entry function named k"):
        compile("__device__ int x;\n", "sm_80", kernel_name="k")


def test_a_tiny_kernel_compiles_for_every_arch():
    src = 'extern "C" __global__ void attngen_tiny(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    for arch in ALL_ARCHS:
        b = compile(src, arch, kernel_name="attngen_tiny")
        assert b.cubin[:4] == b"\x7fELF"
        assert _elf_sm(b.cubin) == get_arch(arch).major * 10 + get_arch(arch).minor
        assert b.resources.registers > 0


SAMPLE_LOG = """\
ptxas info    : 36 bytes gmem, 96 bytes cmem[4]
ptxas info    : Compiling entry function 'attngen_k1' for 'sm_80'
ptxas info    : Function properties for attngen_k1
ptxas         .     24 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 520 bytes cmem[0]
ptxas info    : Compile time = 92.197 ms
ptxas info    : Compiling entry function 'attngen_k10' for 'sm_80'
ptxas info    : Function properties for attngen_k10
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 4096 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 11.000 ms
"""


def test_parse_resources_per_entry():
    assert parse_resources(SAMPLE_LOG, "attngen_k1") == Resources(
        registers=255, smem_static=0, stack_frame=24, spill_stores=16, spill_loads=12)
    # 'attngen_k1' is a prefix of 'attngen_k10': the quotes keep them apart.
    assert parse_resources(SAMPLE_LOG, "attngen_k10") == Resources(
        registers=40, smem_static=4096, stack_frame=0, spill_stores=0, spill_loads=0)


def test_parse_resources_single_and_empty():
    one = SAMPLE_LOG.split("ptxas info    : Compiling entry function 'attngen_k10'")[0]
    assert parse_resources(one) == Resources(registers=255, smem_static=0, stack_frame=24, spill_stores=16,
                                             spill_loads=12)
    assert parse_resources("") == Resources()
    r = parse_resources(SAMPLE_LOG, "attngen_k10")
    assert Resources.from_dict(r.to_dict()) == r
    assert Resources.from_dict({"registers": "7"}) == Resources(registers=7)


def test_load_failure_names_the_cuda_extra_when_the_driver_is_older_than_nvrtc(monkeypatch):
    from attngen import runtime

    class OldDriver:
        def version(self):
            return 12080

    monkeypatch.setattr(runtime, "driver", lambda: OldDriver())
    hint = runtime._driver_hint("13.0")
    assert "12.8" in hint and "NVRTC 13.0" in hint and "'attngen[cu12]'" in hint
    assert runtime._driver_hint("12.9") == ""  # a 12.8 driver loads cubins from NVRTC 12.x


def test_nvrtc_builtins_are_loaded_beside_the_library():
    """The 13.0 wheel's NVRTC, loaded by its path, did not find its builtins library by itself (every compile
    failed); the builtins beside the library are loaded with it. (A fresh process: the order matters.)"""
    import subprocess
    import sys

    code = (
        "from pathlib import Path\n"
        "from attngen._nvrtc import nvrtc\n"
        "lib = nvrtc()\n"
        "b = Path(lib.path).with_name('libnvrtc-builtins.so.{}.{}'.format(*lib.version))\n"
        "if '/' not in lib.path or not b.is_file():\n"
        "    print('skip')\n"
        "else:\n"
        "    maps = open('/proc/self/maps').read()\n"
        "    print('loaded' if str(b.resolve()) in maps or str(b) in maps else 'missing')\n"
        "    cubin, log, _ = lib.compile('extern \"C\" __global__ void k() {}', 'k.cu', ['--gpu-architecture=sm_80'])\n"
        "    print('compiled' if cubin[:4] == b'\\x7fELF' else 'no cubin')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.split()[0] == "skip":
        pytest.skip("NVRTC is not a wheel's library with its builtins beside it here")
    assert out.stdout.split() == ["loaded", "compiled"], out.stdout


def test_a_compile_imports_neither_cupy_nor_numpy():
    # NVRTC is bound through ctypes: CuPy's bindings import CuPy and numpy on first use, which a process's first
    # compile (a cold first call) paid
    import subprocess
    import sys

    code = ("import sys\n"
            "from attngen import compile\n"
            "b = compile('extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }', 'sm_90a', "
            "kernel_name='k')\n"
            "print(b.resources.known, b.resources.registers > 0, [m for m in ('cupy', 'numpy') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "True True []", out.stdout


def test_nvrtc_binding_reports_the_result_code_and_the_log():
    from attngen._nvrtc import NvrtcFailure, nvrtc

    lib = nvrtc()
    assert lib.version == tuple(int(x) for x in nvrtc_version().split("."))
    with pytest.raises(NvrtcFailure) as ei:
        lib.compile("__global__ void k() { undefined_name(); }", "bad.cu", ["--gpu-architecture=sm_80"])
    assert str(ei.value) == "NVRTC_ERROR_COMPILATION (6)" and "bad.cu" in ei.value.log
    assert "undefined_name" in ei.value.log
    with pytest.raises(NvrtcFailure, match="NVRTC_ERROR_INVALID_OPTION"):
        lib.compile("__global__ void k() {}", "k.cu", ["--no-such-option"])
    cubin, log, ptx = lib.compile('extern "C" __global__ void k() {}', "k.cu", ["--gpu-architecture=sm_80"],
                                  want_ptx=True)
    assert cubin[:4] == b"\x7fELF" and ".visible .entry k" in ptx and "\x00" not in ptx


def test_nvrtc_cache_off_where_nvrtc_has_one(monkeypatch):
    # NVRTC 12.9+ caches compiles in the driver's compute cache and then skips ptxas (no report); older ones refuse
    # the option
    assert cache_options("12.8") == () and cache_options("12.0") == ()
    assert cache_options("12.9") == ("--no-cache",) and cache_options("13.0") == ("--no-cache",)
    a = get_arch("sm_90a")
    assert ("--no-cache" in compile_options(a)) == (tuple(map(int, nvrtc_version().split("."))) >= (12, 9))
    import attngen.compiler as compiler

    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "12.8")
    assert "--no-cache" not in compile_options(a)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "13.1")
    assert compile_options(a)[-1] == "--no-cache" and compile_options(a, ("-DX",))[-2:] == ("--no-cache", "-DX")


def test_nvrtc_found_through_cuda_pathfinder_where_no_candidate_loads(monkeypatch):
    # a conda environment or a toolkit outside the loader's path: cuda-pathfinder's search is the last resort, and
    # where that finds nothing either the error names the extras
    import attngen._nvrtc as binding
    import cuda.pathfinder as pathfinder

    monkeypatch.setattr(binding, "library_candidates", lambda: ["/nonexistent/libnvrtc.so.13"])
    binding.nvrtc.cache_clear()
    try:
        lib = binding.nvrtc()
        assert "/" in lib.path and "{}.{}".format(*lib.version) == nvrtc_version()
        cubin, _, _ = lib.compile('extern "C" __global__ void k() {}', "k.cu", ["--gpu-architecture=sm_80"])
        assert cubin[:4] == b"\x7fELF"

        def not_found(name):
            raise pathfinder.DynamicLibNotFoundError(name)

        monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
        binding.nvrtc.cache_clear()
        with pytest.raises(CompileError, match=r"NVRTC not found .*/nonexistent/libnvrtc\.so\.13.*'attngen\[cu13\]'"):
            binding.nvrtc()
    finally:
        binding.nvrtc.cache_clear()
