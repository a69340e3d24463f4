"""The CPU backend patch, checked in a fresh interpreter (it changes process-wide state)."""

import subprocess
import sys

import pytest

import megatron_patches

CODE = r"""
import torch, megatron_patches
assert not megatron_patches.applied()
r = megatron_patches.apply(); r2 = megatron_patches.apply()   # idempotent
assert r == {"cpu_backend": True, "distrib_optimizer_step": True,
              "tied_embedding_checkpoint": True, "moe_router_without_te": True,
              "moe_alltoall_cpu": True, "cpu_backward_devices": True,
              "moe_tensor_parallel_without_sp": True, "moe_allgather_token_counts": True,
              "moe_gloo_split_gather": True, "rope_thd_cached": True, "frozen_linear_folds_tokens": True,
              "checkpoint_writes_in_process": True, "batch_invariant_reduce": True,
              "gloo_cuda_tensors": False} and r2 == r, r   # the gloo-CUDA patch: GPU machines only
x = torch.zeros(2, device="cuda")
assert x.device.type == "cpu" and x.type() == "torch.cuda.FloatTensor"
assert torch.ones(1).cuda().device.type == "cpu"
assert torch.ones(1).to("cuda").device.type == "cpu"
assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
assert x.type(torch.float64).dtype == torch.float64    # type(dtype) still converts
# RNG: megatron's tracker state maps onto the CPU generator
from megatron.core.tensor_parallel import random as r
torch.cuda.manual_seed(5); a = torch.rand(3)
torch.cuda.manual_seed(5); b = torch.rand(3)
assert torch.equal(a, b)
s = r._get_cuda_rng_state(); u = torch.rand(2); r._set_cuda_rng_state(s); assert torch.equal(u, torch.rand(2))
# a frozen linear computes the trainable one's bits on megatron's transposed [s, 1, h] input
from megatron.core.tensor_parallel import layers as L
h = torch.randn(1, 37, 64).transpose(0, 1)   # contiguous, size-1 dimension of stride 37 * 64
w = torch.nn.Parameter(torch.randn(48, 64))
with torch.no_grad():
    frozen = L.LinearWithFrozenWeight.apply(h, w.detach(), None, False, None)
    trained = L.LinearWithGradAccumulationAndAsyncCommunication.apply(h, w, None, False, False, False, None, 0, None)
assert frozen.shape == (37, 1, 48) and torch.equal(frozen, trained)
print("OK")
"""


def test_cpu_backend_in_fresh_process():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_version_check_rejects_untested(monkeypatch):
    monkeypatch.setattr(megatron_patches, "megatron_core_version", lambda: "0.99.0")
    with pytest.raises(megatron_patches.UnsupportedMegatronVersion, match="0.99.0 is untested"):
        megatron_patches.check_version()
