"""Policy, reference and critic modules, and the forward passes the update needs.

Devices are explicit: every module is placed with `.to(device)` from config; nothing is ever
wrapped in `nn.DataParallel` (TRL's auto-wrap spreads training onto the generation GPU).
With LoRA the frozen base doubles as the reference model (adapters disabled), so no second
copy is held.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from agent_rl.buffer import MicroBatch
from agent_rl.config import Config
from agent_rl.losses import entropy_from_logits, token_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(cfg: Config, path: str, device: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.model.dtype]).to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.model.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = cfg.model.lora
        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    return model


def frozen_copy(model: nn.Module, device: str) -> nn.Module:
    import copy

    ref = copy.deepcopy(model).to(device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@contextlib.contextmanager
def reference_mode(policy: nn.Module, ref: nn.Module | None):
    """Yield the module that computes reference log-probs: the frozen copy, or the LoRA base."""
    if ref is not None:
        yield ref
    elif hasattr(policy, "disable_adapter"):
        with policy.disable_adapter():
            yield policy
    else:
        raise RuntimeError("no reference model: algo.kl_coef > 0 needs a frozen copy or LoRA")


class ValueModel(nn.Module):
    """The PPO critic: the policy's backbone (its own copy) plus a scalar head."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = causal_lm.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """values: (B, T); column t is the value of the state before token t (hidden of t-1)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        v = self.head(hidden.float()).squeeze(-1)
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def forward_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False):
    """Token log-probs (B, T) aligned so column t scores token t (column 0 is 0).

    Logits are divided by the sampling temperature, as the engine sampled them (verl does the same).
    Returns (logprobs, entropy or None).
    """
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = token_logprobs(logits, mb.input_ids[:, 1:])
    logprobs = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    entropy = None
    if with_entropy:
        ent = entropy_from_logits(logits)
        entropy = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    return logprobs, entropy


def assert_no_data_parallel(*modules: nn.Module | None) -> None:
    for m in modules:
        if m is None:
            continue
        for sub in m.modules():
            if isinstance(sub, nn.DataParallel):
                raise RuntimeError("nn.DataParallel found in the trainer; devices must be explicit")
