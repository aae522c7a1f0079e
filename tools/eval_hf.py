#!/usr/bin/env python
"""Held-out accuracy of an HF checkpoint (for instance a policy a run exported) with `transformers` alone.

    python tools/eval_hf.py --hf-dir HF --eval-prompt-data eval.jsonl [--apply-chat-template] [--system-prompt S]
        [--max-new-tokens 16] [--batch-size 32] [--compare-eval-json RUN/eval.json --eval-set NAME]

Each prompt is encoded exactly as a run encodes it (the same keys, chat template and system prompt), answered
greedily by `AutoModelForCausalLM.generate` until any EOS id of the checkpoint, and scored by the run's reward
options (--reward-fn, --custom-rm-path, --reward-timeout).

Prompts are answered --batch-size at a time (sorted by length, left-padded): a padded batch runs other matmul shapes
than one prompt alone, so a near-tie between two tokens can break the other way and an answer differ (rarely: float
summation order, not a different model). --compare-eval-json is the exact check, so it answers one prompt at a time,
as the run's engine does: it prints the run's own final accuracy on that set and exits 1 if they differ
(meaningful for a run that evaluated greedily, the default --eval-temperature 0, with one sample per prompt).
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--eval-prompt-data", required=True, metavar="PATH")
    p.add_argument("--input-key", default="prompt")
    p.add_argument("--label-key", default="answer")
    p.add_argument("--metadata-key")
    p.add_argument("--reward-fn", default="math")
    p.add_argument("--custom-rm-path")
    p.add_argument("--reward-timeout", type=int, default=5)
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--system-prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="prompts answered together (1 with --compare-eval-json)")
    p.add_argument("--compare-eval-json", metavar="PATH", help="a run's eval.json to compare with (exact: one "
                   "prompt at a time)")
    p.add_argument("--eval-set", help="the set's name in --compare-eval-json")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.compare_eval_json:
        args.batch_size = 1

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.data.prompts import encode_prompt, stop_token_ids
    from megatron_rl.data.records import RecordFields
    from megatron_rl.models.hf import greedy_responses
    from megatron_rl.rewards import build_reward_fn
    from megatron_rl.rewards.types import RewardSample

    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
    stops = list(stop_token_ids(tokenizer, [args.hf_dir]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    dataset = PromptDataset(args.eval_prompt_data, shuffle=False,
                            fields=RecordFields(args.input_key, args.label_key, args.metadata_key))
    records = [dataset.record(i) for i in range(len(dataset))]
    prompts = [encode_prompt(tokenizer, r["prompt"], args.apply_chat_template, args.system_prompt) for r in records]
    responses = greedy_responses(model, prompts, args.max_new_tokens, stops, pad, args.batch_size, progress=True)
    samples = [RewardSample(prompt=tokenizer.decode(ids, skip_special_tokens=True),
                            response=tokenizer.decode(response), label=record["answer"], metadata=record["metadata"],
                            finish_reason=finish)
               for ids, (response, finish), record in zip(prompts, responses, records)]
    scorer = build_reward_fn(args.reward_fn, 1, args.reward_timeout, args.custom_rm_path)
    try:
        results = scorer(samples)
    finally:
        getattr(scorer, "close", lambda: None)()
    scored = [r for r in results if not r.is_failure]
    if not scored:
        print(f"error: no sample could be scored ({results[0].status}: {results[0].detail})", file=sys.stderr)
        return 2
    accuracy = sum(r.reward == 1.0 for r in scored) / len(scored)
    print(f"{args.hf_dir}: held-out accuracy {accuracy:.4f} ({len(scored)} scored of {len(results)} problems, "
          "greedy, transformers)")
    if args.compare_eval_json:
        with open(args.compare_eval_json) as f:
            run = json.load(f)["eval_sets"][args.eval_set]["after_rl"]["accuracy"]
        same = run is not None and abs(run - accuracy) < 1e-9
        print(f"the run's own evaluation of set {args.eval_set!r} at the end: {run} -> "
              f"{'match' if same else 'MISMATCH'}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
