"""The Triton kernels compile for a real GPU (sm_90 cubin), with no GPU present.

The other kernel tests run under TRITON_INTERPRET, which executes the kernel
source with numpy and is more lenient than the compiler (types of loop-carried
values, scalar/block mixing). Compiling ahead of time with Triton's bundled
ptxas needs no driver, so it runs on CPU-only CI. It runs in a subprocess:
this process has TRITON_INTERPRET set, under which @triton.jit does not build
compilable kernels.
"""
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdec.kernels import sampling_triton, verify_triton

    TARGET = GPUTarget("cuda", 90, 32)

    def compile_kernel(fn, signature, constexprs):
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
        assert kernel.asm["cubin"], fn.__name__

    compile_kernel(sampling_triton._filter_stats_kernel, {
        "logits_ptr": "*fp32", "logits_stride": "i32", "V": "i32", "temperature_ptr": "*fp32",
        "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "row_max_ptr": "*fp32", "threshold_ptr": "*fp32",
        "norm_ptr": "*fp32", "BLOCK": "constexpr", "SEARCH_BLOCK": "constexpr", "PROBES": "constexpr",
    }, {"BLOCK": 1024, "SEARCH_BLOCK": 256, "PROBES": 16})

    VERIFY_SIGNATURE = {
        "logits_ptr": "*fp32", "logits_stride": "i32", "V": "i32", "row_max_ptr": "*fp32",
        "threshold_ptr": "*fp32", "norm_ptr": "*fp32", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
        "position_ptr": "*i64", "policy_ptr": "*i32", "num_draft_ptr": "*i64", "draft_start_ptr": "*i64",
        "draft_ids_ptr": "*i32", "q_ids_ptr": "*i32", "q_probs_ptr": "*fp32", "q_width": "i32",
        "seq_ids_ptr": "*i64", "out_ptr": "*i32", "out_stride": "i32", "num_accepted_ptr": "*i32",
        "STRATEGY": "constexpr", "HAS_Q": "constexpr", "Q_PAD": "constexpr", "OUT_PAD": "constexpr",
        "BLOCK": "constexpr",
    }
    for strategy in (1, 2, 3, 4):
        for has_q in (False, True):
            compile_kernel(verify_triton._verify_kernel, VERIFY_SIGNATURE, {
                "STRATEGY": strategy, "HAS_Q": has_q, "Q_PAD": 8 if has_q else 1, "OUT_PAD": 32, "BLOCK": 1024})
    print("compiled")
""")


def test_kernels_compile_for_sm90(tmp_path):
    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, not a cached cubin
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence Triton's warning
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
