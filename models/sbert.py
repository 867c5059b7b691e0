"""A sentence-embedding transformer with token inputs, spelled as torch.onnx exports a sentence-transformers
model (all-MiniLM-L6-v2's shape by default): int64 input_ids / attention_mask / token_type_ids; word,
position and token-type embeddings by Gather; the additive attention mask built from the attention mask
with bool ops (Equal, Not, And, Unsqueeze/Expand of a bool tensor, Where); BERT layers (LayerNorm, Erf
GELU); mean pooling over the mask; and F.normalize's L2 normalization (ReduceL2, Clip, Expand, Div).

It exists because models exported by other tools use integer and bool tensors and ops that float-only
builders never do; the encoder layers themselves are models/bert.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from models.bert import LAYERNORM_SPELLINGS, _Bert

MASK_MIN = float(np.finfo(np.float32).min)  # what HF adds at masked positions


@dataclass(frozen=True)
class Config:
    layers: int = 6
    hidden: int = 384
    heads: int = 12
    ffn: int = 1536
    seq: int = 128
    batch: int = 1
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    layernorm: str = "primitive"  # torch.onnx's spelling at opset 14; "op" = LayerNormalization (opset 17)


PAPER = Config()
TINY = Config(layers=2, hidden=64, heads=4, ffn=128, seq=16, vocab=1000, max_positions=64)


class _SentenceBert(_Bert):
    def __init__(self, config: Config, seed: int):
        if config.layernorm not in LAYERNORM_SPELLINGS:
            raise ValueError(f"layernorm must be one of {LAYERNORM_SPELLINGS}, got {config.layernorm!r}")
        if config.seq > config.max_positions:
            raise ValueError(f"seq ({config.seq}) exceeds max_positions ({config.max_positions})")
        super().__init__(config, seed)
        self.b.name = "sbert"
        self.b.opset = 17 if config.layernorm == "op" else 14
        self.mask = None

    def embeddings(self, input_ids: str, token_type_ids: str) -> str:
        b, c = self.b, self.c
        word = b.weight("word_embeddings", (c.vocab, c.hidden), scale=0.5)
        position = b.weight("position_embeddings", (c.max_positions, c.hidden), scale=0.5)
        token_type = b.weight("token_type_embeddings", (c.type_vocab, c.hidden), scale=0.5)
        # position_ids: a registered buffer [1, max_positions], sliced to the sequence length
        buffer = b.const("position_ids", np.arange(c.max_positions, dtype=np.int64)[None])
        ids = b.node("Slice", [buffer, b.const("zero_1d", np.array([0], np.int64)),
                               b.const("seq_1d", np.array([c.seq], np.int64)),
                               b.const("one_1d", np.array([1], np.int64))], name="embeddings/position_ids")
        x = b.node("Gather", [word, input_ids], name="embeddings/word")
        x = b.node("Add", [x, b.node("Gather", [token_type, token_type_ids], name="embeddings/token_type")],
                   name="embeddings/add_type")
        x = b.node("Add", [x, b.node("Gather", [position, ids], name="embeddings/position")],
                   name="embeddings/add_position")
        return self.layernorm(x, "embeddings/ln")

    def additive_mask(self, attention_mask: str) -> str:
        """[B, 1, S, S] float: 0 where a key may be attended to, float32 min where it is padding."""
        b, c = self.b, self.c
        keep = b.node("Equal", [attention_mask, b.const("one_i64", np.array(1, np.int64))], name="mask/equal")
        negative = b.node("Less", [attention_mask, b.const("zero_i64", np.array(0, np.int64))], name="mask/less")
        valid = b.node("And", [keep, b.node("Not", [negative], name="mask/not")], name="mask/and")
        axes = b.const("mask_axes", np.array([1, 2], np.int64))
        valid = b.node("Unsqueeze", [valid, axes], name="mask/unsqueeze")
        valid = b.node("Expand", [valid, b.const("mask_shape", np.array([c.batch, 1, c.seq, c.seq], np.int64))],
                       name="mask/expand")
        return b.node("Where", [valid, b.const("mask_zero", np.float32(0.0)),
                                b.const("mask_min", np.float32(MASK_MIN))], name="mask/where")

    def attention(self, x: str, p: str) -> str:
        """models/bert.py's attention with the additive mask added to the scaled scores."""
        b, h = self.b, self.c.hidden

        def heads(name: str, perm: list[int]) -> str:
            y = self.linear(x, h, h, f"{p}/{name}")
            y = b.node("Reshape", [y, self.heads_shape], name=f"{p}/{name}_reshape")
            return b.node("Transpose", [y], name=f"{p}/{name}_transpose", perm=perm)

        q, k, v = heads("q", [0, 2, 1, 3]), heads("k", [0, 2, 3, 1]), heads("v", [0, 2, 1, 3])
        scores = b.node("Div", [b.node("MatMul", [q, k], name=f"{p}/scores"), self.sqrt_dh], name=f"{p}/scale")
        scores = b.node("Add", [scores, self.mask], name=f"{p}/mask_add")
        probs = b.node("Softmax", [scores], name=f"{p}/softmax", axis=-1)
        ctx = b.node("MatMul", [probs, v], name=f"{p}/context")
        ctx = b.node("Transpose", [ctx], name=f"{p}/context_transpose", perm=[0, 2, 1, 3])
        ctx = b.node("Reshape", [ctx, self.hidden_shape], name=f"{p}/context_reshape")
        return self.linear(ctx, h, h, f"{p}/out")

    def pool_and_normalize(self, x: str, attention_mask: str) -> str:
        """sentence-transformers' mean pooling over the mask, then F.normalize(p=2, dim=1)."""
        b, c = self.b, self.c
        mask = b.node("Cast", [attention_mask], name="pool/cast", to=TensorProto.FLOAT)
        mask = b.node("Unsqueeze", [mask, b.const("pool_axes", np.array([-1], np.int64))], name="pool/unsqueeze")
        mask = b.node("Expand", [mask, b.node("Shape", [x], name="pool/shape")], name="pool/expand")
        axis1 = b.const("axis1", np.array([1], np.int64))
        summed = b.node("ReduceSum", [b.node("Mul", [x, mask], name="pool/mul"), axis1], name="pool/sum",
                        keepdims=0)
        count = b.node("ReduceSum", [mask, axis1], name="pool/count", keepdims=0)
        count = b.node("Clip", [count, b.const("count_min", np.float32(1e-9))], name="pool/clip")
        mean = b.node("Div", [summed, count], name="pool/mean")
        norm = b.node("ReduceL2", [mean], name="normalize/norm", axes=[1], keepdims=1)
        norm = b.node("Clip", [norm, b.const("norm_min", np.float32(1e-12))], name="normalize/clip")
        norm = b.node("Expand", [norm, b.node("Shape", [mean], name="normalize/shape")], name="normalize/expand")
        return b.node("Div", [mean, norm], name="sentence_embedding")

    def build(self) -> onnx.ModelProto:
        b, c = self.b, self.c
        tokens = [c.batch, c.seq]
        input_ids = b.input("input_ids", tokens, TensorProto.INT64)
        attention_mask = b.input("attention_mask", tokens, TensorProto.INT64)
        token_type_ids = b.input("token_type_ids", tokens, TensorProto.INT64)
        self.mask = self.additive_mask(attention_mask)
        x = self.embeddings(input_ids, token_type_ids)
        for i in range(c.layers):
            p = f"layer{i}"
            x = self.layernorm(b.node("Add", [x, self.attention(x, f"{p}/attn")], name=f"{p}/attn/residual"),
                               f"{p}/attn/ln")
            x = self.layernorm(b.node("Add", [x, self.ffn(x, f"{p}/ffn")], name=f"{p}/ffn/residual"),
                               f"{p}/ffn/ln")
        b.output(self.pool_and_normalize(x, attention_mask), [c.batch, c.hidden])
        return b.model()


def build(config: Config = PAPER, seed: int = 0) -> onnx.ModelProto:
    return _SentenceBert(config, seed).build()


def example_feeds(config: Config = PAPER, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids, a mask with trailing padding (about a quarter of the sequence) and two segments."""
    rng = np.random.default_rng(seed)
    shape = (config.batch, config.seq)
    mask = np.ones(shape, np.int64)
    mask[:, config.seq - config.seq // 4:] = 0
    types = np.zeros(shape, np.int64)
    types[:, config.seq // 2:] = 1
    return {"input_ids": rng.integers(0, config.vocab, shape, dtype=np.int64), "attention_mask": mask,
            "token_type_ids": types}
