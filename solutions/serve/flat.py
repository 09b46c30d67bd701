"""The reference bodies of engine/serve/flat.py's holes (the chapter's answers).

Each function runs in that module's namespace (engine/_impl.py puts it there), so it uses the
module's names as they are; its contract is the hole's docstring in engine/serve/flat.py.
"""
from __future__ import annotations

from engine.models.layers import add_norm
from engine.rope import rope_cos_sin


class FlatModel:
    def attention(self, attn, x, cos, sin, kv_cache, meta, backend):
        q, k, v = attn.qkv(x, cos, sin)  # [N, Hq, Dh], [N, Hkv, Dh], [N, Hkv, Dh]
        backend.write(kv_cache, k, v, meta)
        o = backend.forward(q, kv_cache, meta, scale=attn.scale, window=self.cfg.sliding_window)
        return attn.o_proj(o.reshape(x.shape[0], -1))  # [N, Hq * Dh] -> [N, D]

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        m = self.model.model
        hidden = m.embed_tokens(input_ids)  # [N, D]
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)

        def attend(i, attn, x, cos, sin):  # layer i attends through its own pool
            return self.attention(attn, x, cos, sin, kv_caches[i], meta, backend)

        hidden, residual = m.run_layers(hidden, cos, sin, attend)
        out, _ = add_norm(hidden, residual, m.norm)
        return out
