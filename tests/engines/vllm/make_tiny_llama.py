"""Makes a tiny Llama for the vLLM tests from a fixed seed: no hub download, no tokenizer (the
tests send token ids). The weights are scaled so greedy argmax margins are large: the
disaggregated and the local run must agree token for token, and a tie broken by a rounding
difference would make the test flaky rather than wrong.

    python make_tiny_llama.py OUT_DIR [--layers 2] [--kv-heads 2] [--heads 4] [--head-dim 32]
"""

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)  # the CPU backend wants 32, 64, 80, ...
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = os.path.join(a.out, "kvstage-tiny.json")
    want = vars(a).copy()
    want.pop("out")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                print(f"{a.out}: up to date")
                return 0

    torch.manual_seed(a.seed)
    hidden = a.heads * a.head_dim
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        # Attention that really reads the context: larger q/k so the scores are not flat.
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
        # Large logit margins: greedy decisions far from ties.
        model.lm_head.weight.mul_(30.0)
        # Never emit EOS: outputs run to max_tokens.
        model.lm_head.weight[cfg.eos_token_id].zero_()
    model.save_pretrained(a.out, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(want, f)

    # Margins on a few prompts (the top-1 minus top-2 logit), for the log.
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, a.vocab, (4, 64), generator=g)
    with torch.no_grad():
        logits = model(ids).logits
    top = logits.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).flatten()
    print(f"{a.out}: {sum(p.numel() for p in model.parameters())} parameters; logit margin min {gap.min():.3f} median {gap.median():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
