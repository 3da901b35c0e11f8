"""`pagedkv bench kv-dtype`: what an fp8 KV cache costs in accuracy, measured
through `/v1/completions` as a user would see it.

One worker per `--kv-cache-dtype` (`auto` first: the reference), started one
after the other on the same model, prompts and `--kv-cache-memory`:

- logprob difference: `auto`'s greedy continuation of each prompt is scored
  by every worker (the continuation's tokens' `prompt_logprobs` after the
  prompt); mean and max |logprob - auto's| over all those tokens, in nats;
- greedy agreement: the share of prompts whose greedy continuation is
  `auto`'s token for token, over its first N tokens (each of `tokens`);
- multiple choice: `MULTIPLE_CHOICE`'s questions scored as lm-eval scores
  them, with `echo` + `logprobs`: each option's summed log-likelihood after
  the question, the highest one the answer; the accuracy;
- capacity: the pool's blocks (`kv_pool_blocks`) for the same memory.

Targets (issue 42): mean |logprob diff| <= 0.05 nats, multiple-choice
accuracy within 2 points of `auto`. A random-weight model (`--workload
small`) has flat logits, so its greedy tokens part ways at the smallest
difference: its figures check the plumbing, not the format.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedkv.bench import harness
from pagedkv.bench.harness import Table, cell
from pagedkv.bench.workloads import KV_DTYPE, MULTIPLE_CHOICE, QUESTIONS, KVDtypeWorkload

__all__ = ["add_arguments", "measure", "run", "tables"]

DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
REFERENCE = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_workload_option(parser, KV_DTYPE)
    parser.add_argument("--model", default=None, help="the model (default: the workload's)")
    parser.add_argument(
        "--kv-cache-dtype",
        type=harness.comma_list(DTYPES),
        default="fp8",
        metavar="LIST",
        help="comma list of fp8 formats compared with auto",
    )
    harness.add_json_option(parser)


class _Worker:
    """One worker process of `model` with `--kv-cache-dtype kv`, and its API."""

    def __init__(self, model: str, kv: str, w: KVDtypeWorkload) -> None:
        from pagedkv.stack import WorkerProcess

        self.proc = WorkerProcess(
            f"kv-{kv}",
            model=model,
            args=[
                "--kv-cache-dtype",
                kv,
                "--kv-cache-memory",
                w.kv_cache_memory,
                "--log-level",
                "warning",
            ],
        )

    def __enter__(self) -> _Worker:
        import httpx

        self.proc.start().wait_healthy(300)
        self.http = httpx.Client(base_url=self.proc.url, timeout=600)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.proc.terminate()

    def complete(self, prompt: list[int], max_tokens: int, **kw: Any) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **kw,
        }
        r = self.http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]

    def tokenize(self, text: str) -> list[int]:
        r = self.http.post("/tokenize", json={"prompt": text})
        r.raise_for_status()
        return r.json()["tokens"]

    def pool_blocks(self) -> int:
        return int(
            next(
                s.value
                for s in harness.metric_samples(self.proc.url)
                if s.name == "pagedkv_worker_kv_pool_blocks"
            )
        )

    def scores(self, prompt: list[int], continuation: list[int]) -> list[float]:
        """The logprob of each token of `continuation` after `prompt`."""
        entries = self.complete(prompt + continuation, 1, prompt_logprobs=0)["prompt_logprobs"]
        ids = prompt + continuation
        return [entries[i][str(ids[i])]["logprob"] for i in range(len(prompt), len(ids))]


def _run_worker(
    model: str, kv: str, w: KVDtypeWorkload, prompts: list[str], reference: dict | None
) -> dict[str, Any]:
    """One worker's answers: token ids, continuations, their scores, the choices."""
    with _Worker(model, kv, w) as worker:
        ids = [worker.tokenize(p) for p in prompts]
        greedy = [worker.complete(p, max(w.tokens))["token_ids"] for p in ids]
        ref_greedy = reference["greedy"] if reference is not None else greedy
        scored = [worker.scores(p, c) for p, c in zip(ids, ref_greedy, strict=True)]
        picks = []
        for question, options, _ in MULTIPLE_CHOICE[: w.questions]:
            context = worker.tokenize(question)
            totals = []
            for option in options:
                full = worker.tokenize(f"{question} {option}")
                cut = (
                    len(context)
                    if full[: len(context)] == context
                    else len(full) - len(worker.tokenize(option))
                )
                totals.append(sum(worker.scores(full[:cut], full[cut:])))
            picks.append(max(range(len(options)), key=totals.__getitem__))
        return {
            "greedy": greedy,
            "scores": scored,
            "picks": picks,
            "kv_pool_blocks": worker.pool_blocks(),
        }


def _summary(run: dict, reference: dict, w: KVDtypeWorkload) -> dict[str, Any]:
    diffs = [
        abs(a - b)
        for s, r in zip(run["scores"], reference["scores"], strict=True)
        for a, b in zip(s, r, strict=True)
    ]
    answers = [a for _, _, a in MULTIPLE_CHOICE[: w.questions]]
    return {
        "logprob_diff_mean_nats": sum(diffs) / len(diffs) if diffs else None,
        "logprob_diff_max_nats": max(diffs) if diffs else None,
        "greedy_identical": {
            str(n): sum(
                g[:n] == r[:n] for g, r in zip(run["greedy"], reference["greedy"], strict=True)
            )
            / len(run["greedy"])
            for n in w.tokens
        },
        "multiple_choice_accuracy": sum(p == a for p, a in zip(run["picks"], answers, strict=True))
        / len(answers),
        "kv_pool_blocks": run["kv_pool_blocks"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    w = KV_DTYPE[args.workload]
    model = args.model or w.model
    prompts = list(QUESTIONS[: w.prompts])
    harness.log("kv-dtype", f"{model}: auto (the reference)")
    reference = _run_worker(model, REFERENCE, w, prompts, None)
    runs = {REFERENCE: reference}
    for kv in args.kv_cache_dtype:
        harness.log("kv-dtype", f"{model}: {kv}")
        runs[kv] = _run_worker(model, kv, w, prompts, reference)
    return {
        "benchmark": "fp8 KV cache against the model's dtype",
        "model": model,
        "workload": {
            "name": args.workload,
            "prompts": len(prompts),
            "tokens": list(w.tokens),
            "questions": w.questions,
            "kv_cache_memory": w.kv_cache_memory,
        },
        "results": {kv: _summary(r, reference, w) for kv, r in runs.items()},
    }


def tables(report: dict[str, Any]) -> list[Table]:
    w = report["workload"]
    tokens = [str(n) for n in w["tokens"]]
    rows = [
        [
            kv,
            cell(r["logprob_diff_mean_nats"], ".4f"),
            cell(r["logprob_diff_max_nats"], ".3f"),
            *(cell(r["greedy_identical"][n], ".0%") for n in tokens),
            cell(r["multiple_choice_accuracy"], ".0%"),
            cell(r["kv_pool_blocks"], ","),
        ]
        for kv, r in report["results"].items()
    ]
    return [
        Table(
            title=f"{report['benchmark']}: {report['model']}, {w['prompts']} prompts, "
            f"{w['questions']} questions, {w['kv_cache_memory']} of KV",
            columns=[
                "kv-cache-dtype",
                "mean |dlogprob|",
                "max |dlogprob|",
                *(f"greedy = auto, {n} tok" for n in tokens),
                "multiple choice",
                "pool blocks",
            ],
            rows=rows,
            notes=[
                "dlogprob: nats per token of auto's greedy continuation; targets: mean <= 0.05, "
                "multiple choice within 2 points of auto"
            ],
        )
    ]


def run(args: argparse.Namespace) -> int:
    """The `pagedkv bench kv-dtype` entry point: print the report, exit status 0."""
    return harness.run("kv-dtype", args, measure, tables)
