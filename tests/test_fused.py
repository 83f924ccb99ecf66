"""Fused RMSNorm and SwiGLU: the same values and gradients as transformers' modules, the same
update step on a real model, and fewer bytes saved for the backward."""

import random

import pytest
import torch
from test_levers import _batch, _cfg

from agent_rl.infra.plan import Arch, activation_bytes
from agent_rl.learn.fused import RMSNormFn, SwiGLUFn, fuse_module, fuse_modules
from agent_rl.learn.policy import load_policy
from agent_rl.learn.update import prepare_batch, update


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)


def test_fused_rmsnorm_and_mlp_match_transformers_values_and_gradients():
    """A Qwen2 RMSNorm and MLP with the fused forward give transformers' outputs and input and
    weight gradients to float rounding; a float64 input takes the original forward."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    torch.manual_seed(0)
    config = _qwen2_config()
    for module in (Qwen2RMSNorm(64, eps=1e-6), Qwen2MLP(config)):
        if isinstance(module, Qwen2RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
        x = torch.randn(3, 7, 64, requires_grad=True)
        out = module(x)
        grad_out = torch.randn_like(out)
        ref = torch.autograd.grad(out, [x, *module.parameters()], grad_out)
        assert fuse_module(module)
        fused_out = module(x)
        got = torch.autograd.grad(fused_out, [x, *module.parameters()], grad_out)
        assert fused_out.grad_fn is not None and fused_out.grad_fn is not out.grad_fn
        torch.testing.assert_close(fused_out, out, atol=1e-6, rtol=1e-5)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        x64 = x.detach().double()
        module.double()
        assert "RMSNormFn" not in type(module(x64).grad_fn or object()).__name__


def test_fused_functions_pass_gradcheck():
    """Both backward passes are the exact derivative of their forward (float64 finite differences)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, 1e-6), (x, w))
    g = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFn.apply, (g, u))


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `fn()`."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_fused_model_updates_like_the_plain_one_and_saves_fewer_activations(tiny_model_dir):
    """On the tiny Qwen2, `train.fused_ops` rebinds every RMSNorm and MLP; one GRPO update moves
    the parameters as the plain model's does (to float tolerance), and the forward keeps (2 h + f)
    fewer bytes per token and layer for the backward (plus h for the final norm), as the planner's
    activation model says."""
    results, saved = {}, {}
    for fused in (True, False):
        torch.manual_seed(0)
        cfg = _cfg(tiny_model_dir, f"train.fused_ops={str(fused).lower()}", "train.share_prompt_prefix=false")
        policy = load_policy(cfg, str(tiny_model_dir), "cpu")
        layers = policy.config.num_hidden_layers
        if fused:
            assert fuse_modules(policy) == 3 * layers + 1  # two norms and an MLP a layer, the final norm
        opt = torch.optim.SGD(policy.parameters(), lr=0.5)
        trajs = _batch(policy.config.vocab_size, groups=3, n=2)
        batch = prepare_batch(cfg, policy, None, None, trajs, 0, need_old=False)
        update(cfg, policy, None, opt, None, batch, random.Random(0))
        results[fused] = {k: v.clone() for k, v in policy.state_dict().items()}
        ids = batch.rows.input_ids
        saved[fused] = _saved_bytes(lambda: policy(input_ids=ids, use_cache=False).logits.sum())
    for k, plain in results[False].items():
        torch.testing.assert_close(results[True][k], plain, atol=1e-5, rtol=1e-4, msg=k)
    c = policy.config
    tokens = ids.numel()
    per_layer = 4 * tokens * (2 * c.hidden_size + c.intermediate_size)
    final_norm = 4 * tokens * c.hidden_size
    assert saved[False] - saved[True] == layers * per_layer + final_norm
    arch = Arch(c.hidden_size, layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, 1, True)
    planned_drop = activation_bytes(arch, tokens, 1, tokens, 4, False) - activation_bytes(
        arch, tokens, 1, tokens, 4, False, fused=True
    )
    assert planned_drop == layers * per_layer  # the planner's model is per layer


@pytest.mark.parametrize("model_type", ["qwen2", "gemma", "gpt2"])
def test_only_known_families_are_fused(model_type):
    """A model whose config names a known family gets its RMSNorm and MLP fused; families whose
    norm or MLP is written differently (Gemma's 1 + weight, GPT-2's LayerNorm) are left as loaded,
    whatever their modules are called."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"model_type": model_type, "hidden_act": "silu"})()
            self.norm, self.mlp = Qwen2RMSNorm(64), Qwen2MLP(_qwen2_config())

    model = Fake()
    expected = 2 if model_type == "qwen2" else 0
    assert fuse_modules(model) == expected
    assert ("forward" in vars(model.norm)) == (expected > 0) and ("forward" in vars(model.mlp)) == (expected > 0)
