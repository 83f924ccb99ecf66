"""The encoder's forward with its pooling, in torch: what the ONNX export traces and what the torch
runtime runs (imported only there: an ONNX encoder's server never imports torch)."""

import torch


class Pooled(torch.nn.Module):
    """model -> unit-norm sentence vectors (batch, dim): the graph exported to ONNX and the torch
    runtime's forward alike, so the two pool the same way."""

    def __init__(self, model: torch.nn.Module, pooling: str):
        super().__init__()
        self.model, self.pooling = model, pooling

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        if self.pooling == "cls":
            emb = hidden[:, 0]
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(emb.float(), dim=-1)
