"""Were a server's greedy answers its model's own? Each answer teacher-forced through the model alone: every
token must be the argmax given its own prompt and the answer's tokens before it, or tie with it (a logit within
`TIE` of the best: batch numerics may pick either). An answer that fails was decoded wrong, or mixed up with a
neighbour's in a batch. Used by `headstart loadtest --soak S --check-answers`."""

from __future__ import annotations

import torch

from headstart.runtime.tokens import chat_ids

TIE = 1e-4  # logits this close to the best are a tie (DESIGN.md's tie rule)


@torch.inference_mode()
def check_answers(model, tokenizer, answers: list[dict]) -> dict:
    """`answers`: {"prompt": user text, "token_ids": the answer's ids}, as `loadtest.soak` collects them. Returns
    {"checked", "tokens", "wrong": [{"prompt", "at", "token", "argmax", "gap"} ...]}; the first wrong token of
    each wrong answer."""
    wrong, tokens = [], 0
    for a in answers:
        prompt, answer = chat_ids(tokenizer, [{"role": "user", "content": a["prompt"]}]), list(a["token_ids"])
        if not answer:
            continue
        ids = torch.tensor([prompt + answer], device=model.device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (len(answer), V): predicts each token
        chosen = torch.tensor(answer, device=logits.device)
        gap = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]  # (len(answer),) >= 0
        tokens += len(answer)
        bad = (gap > TIE).nonzero()
        if len(bad):
            at = int(bad[0])
            wrong.append(
                {
                    "prompt": a["prompt"][:80],
                    "at": at,
                    "token": answer[at],
                    "argmax": int(logits[at].argmax()),
                    "gap": float(gap[at]),
                }
            )
    return {"checked": len(answers), "tokens": tokens, "wrong": wrong}
