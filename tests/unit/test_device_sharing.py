"""Several ranks on one GPU: the backend check, the device each rank takes, and the host staging of
gloo's sends and receives (megatron_patches.gloo_cuda_tensors), each without a GPU."""

import pytest
import torch

from megatron_patches import gloo_cuda_tensors
from puzzle.parallel import device


@pytest.fixture
def gpus(monkeypatch):
    """A node with ``n`` GPUs and ``ranks`` local ranks, this one ``local_rank``."""
    def make(n, ranks, local_rank=0):
        monkeypatch.setattr(device, "accelerator_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return make


def test_nccl_refuses_more_ranks_than_gpus(gpus):
    gpus(1, 4)
    problem = device.device_sharing_problem("nccl")
    assert "4 ranks on this node share 1 GPU" in problem and "--distributed-backend gloo" in problem
    assert device.device_sharing_problem("gloo") is None
    gpus(4, 4)
    assert device.device_sharing_problem("nccl") is None


def test_nccl_without_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(device, "accelerator_available", lambda: False)
    assert "NCCL needs GPUs" in device.device_sharing_problem("nccl")
    assert device.device_sharing_problem("gloo") is None
    assert device.default_backend() == "gloo"


def test_ranks_beyond_the_gpus_share_them(gpus):
    gpus(2, 4, local_rank=3)
    assert device.local_device() == torch.device("cuda", 1)
    gpus(1, 4, local_rank=2)
    assert device.local_device() == torch.device("cuda", 0)


class _Work:
    def __init__(self):
        self.waited = 0

    def wait(self, *args, **kwargs):
        self.waited += 1
        return True


def _recorder():
    calls = []

    def original(tensor, *args, **kwargs):
        calls.append(tensor)
        tensor.fill_(7.0) if tensor.dtype.is_floating_point else None
        return _Work()
    return calls, original


def test_staged_messages_go_through_host_buffers(monkeypatch):
    monkeypatch.setattr(gloo_cuda_tensors, "_staged", lambda tensor, group: True)
    calls, original = _recorder()
    target = torch.zeros(3, requires_grad=True)  # as megatron's pipeline receive buffers
    work = gloo_cuda_tensors._wrap_receive(original, blocking=False)(target, 1, group="g")
    assert calls[0] is not target and target.sum() == 0  # lands in a host buffer first
    assert work.wait() and target.tolist() == [7.0, 7.0, 7.0] and target.requires_grad
    assert work.is_completed()
    work.wait()  # a second wait copies nothing again
    target = torch.zeros(2, requires_grad=True)
    gloo_cuda_tensors._wrap_receive(original, blocking=True)(target, 1, None)
    assert target.tolist() == [7.0, 7.0]  # recv: at once
    went = []
    gloo_cuda_tensors._wrap_send(lambda t, *a, **k: went.append(t))(torch.ones(2), 1)
    assert went[0].device.type == "cpu" and went[0].tolist() == [1.0, 1.0]  # a host copy went out


def test_unstaged_messages_pass_through(monkeypatch):
    monkeypatch.setattr(gloo_cuda_tensors, "_staged", lambda tensor, group: False)
    calls, original = _recorder()
    target = torch.zeros(2)
    work = gloo_cuda_tensors._wrap_receive(original, blocking=False)(target, 1, group="g")
    assert calls[0] is target and isinstance(work, _Work)
    sent = torch.ones(2)
    gloo_cuda_tensors._wrap_send(original)(sent, 1)
    assert calls[-1] is sent


def test_group_argument_found_by_position_or_name():
    assert gloo_cuda_tensors._group_of((1, "g"), {}) == "g"
    assert gloo_cuda_tensors._group_of((1,), {"group": "h"}) == "h"
    assert gloo_cuda_tensors._group_of((1,), {}) is None


def test_coalescing_on_gloo_runs_collectives_one_by_one(monkeypatch):
    entered = []

    @__import__("contextlib").contextmanager
    def original(group=None, device=None, async_ops=False):
        entered.append(group)
        yield "torch's manager"

    manager = gloo_cuda_tensors._wrap_coalescing(original)
    monkeypatch.setattr(gloo_cuda_tensors, "_on_gloo", lambda group: False)
    with manager("nccl group") as cm:
        assert cm == "torch's manager"
    monkeypatch.setattr(gloo_cuda_tensors, "_on_gloo", lambda group: True)
    with manager("gloo group") as cm:
        assert cm is None
    assert entered == ["nccl group"]  # torch's manager (and its allreduce_coalesced) left out on gloo
    with pytest.raises(NotImplementedError, match="use NCCL"):
        with manager("gloo group", async_ops=True):
            pass


def test_sdpa_core_attention_saves_without_global_groups():
    """The GPU default attention (SDPA) must not fall back to megatron's global tensor-parallel
    group when a checkpoint is saved: puzzle never initialises it (first seen on a GPU)."""
    import megatron_patches

    megatron_patches.apply()
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from puzzle.models.sdpa_attention import SDPACoreAttention

    class Groups:
        tp = "the model's tp group"

    attention = SDPACoreAttention(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2), 1, AttnMaskType.causal, "self",
                                  pg_collection=Groups())
    assert attention.tp_group == Groups.tp
    assert attention.sharded_state_dict(prefix="layer.", metadata={"dp_cp_group": None}) == {}
