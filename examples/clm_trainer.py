"""Causal language modelling with the HF Trainer the way transformers' ``run_clm.py`` drives it, plus easyckpt.

    torchrun --nproc-per-node=2 examples/clm_trainer.py --train_file corpus.txt --output_dir /tmp/clm \\
        --use_cpu --max_steps 40 --save_steps 10 --logging_steps 1 --report_to none --resume_newest
    # kill -9 a rank mid-training and run the same command again: it resumes (memory, replica, disk)

What ``run_clm.py`` does, from local files only: ``HfArgumentParser`` parses the command line into
``TrainingArguments`` and this script's own dataclass; ``datasets.load_dataset("text", data_files=...)``
reads the text file, ``map`` tokenizes it (under ``main_process_first``) and groups the tokens into blocks
of ``--block_size``; the tokenizer is a word-level ``tokenizers`` model trained on the same file and
wrapped in ``PreTrainedTokenizerFast``; the model is a tiny GPT-2 built from a config. The wrapper is the
two-line change a ``run_clm.py`` user makes (marked ``easyckpt:`` below). DeepSpeed: ``--deepspeed ds.json``
(with ``DS_ACCELERATOR=cpu`` on a machine without GPUs).

For the tests, each rank appends one JSON line per logged step to ``--log_dir/losses-rank<r>.jsonl`` and
writes its pid there; ``--step_seconds`` adds busy compute per step so that a kill lands mid-training.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import torch.distributed as dist
import transformers
from datasets import load_dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from easyckpt.transformers import TrainerWrapper  # easyckpt: line 1 of 2

logger = logging.getLogger(__name__)


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "a local text file, one example per line"})
    block_size: int = field(default=32, metadata={"help": "tokens per training example after grouping"})
    vocab_size: int = field(default=256, metadata={"help": "word-level vocabulary trained on train_file"})
    n_layer: int = 2
    n_embd: int = 32
    cache_dir: str | None = field(default=None, metadata={"help": "datasets' cache (default: its own)"})
    resume_newest: bool = field(default=False, metadata={"help": "train(resume_from_checkpoint=True)"})
    plain: bool = field(default=False, metadata={"help": "the plain Trainer, without easyckpt"})
    log_dir: str | None = field(default=None, metadata={"help": "per-rank loss logs and pid files (tests)"})
    step_seconds: float = field(default=0.0, metadata={"help": "busy compute per step (tests)"})


def build_tokenizer(train_file: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the training file: the same on every rank (deterministic)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "[EOS]"])
    tokenizer.train([train_file], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]",
                                   pad_token="[EOS]")


def lm_dataset(args: ScriptArguments, training_args: TrainingArguments, tokenizer: PreTrainedTokenizerFast) -> Any:
    raw = load_dataset("text", data_files={"train": args.train_file}, cache_dir=args.cache_dir)
    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # As run_clm.py: concatenate, drop the remainder, cut into block_size chunks; labels are the inputs.
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // args.block_size) * args.block_size
        result = {k: [t[i:i + args.block_size] for i in range(0, total, args.block_size)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        grouped = tokenized.map(group_texts, batched=True)
    return grouped["train"]


class LossLog(TrainerCallback):
    """One JSON line per logged step with what the Trainer logged: what the tests compare."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path = path
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        deadline = time.perf_counter() + self.seconds
        while time.perf_counter() < deadline:   # busy compute, so that a test's kill lands mid-training
            pass

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            row = {"step": state.global_step, "loss": logs["loss"], "grad_norm": logs.get("grad_norm"),
                   "learning_rate": logs.get("learning_rate"), "epoch": logs.get("epoch")}
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)

    tokenizer = build_tokenizer(args.train_file, args.vocab_size)
    train_dataset = lm_dataset(args, training_args, tokenizer)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=2, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    callbacks: list[TrainerCallback] = []
    if args.log_dir is not None:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"pid-rank{training_args.process_index}").write_text(str(os.getpid()))
        callbacks.append(LossLog(log_dir / f"losses-rank{training_args.process_index}.jsonl", args.step_seconds))
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
                      data_collator=default_data_collator, callbacks=callbacks)
    if not args.plain:
        trainer = TrainerWrapper(trainer, save_mem_interval=1)  # type: ignore[assignment]  # easyckpt: line 2 of 2
    result = trainer.train(resume_from_checkpoint=True if args.resume_newest else None)
    trainer.log_metrics("train", result.metrics)
    if dist.is_initialized():
        dist.barrier()
    # As examples/hf_trainer.py: collect the Trainer and destroy the gloo group while the interpreter is
    # whole (an implicit teardown at exit can deadlock, pytorch/pytorch#190489).
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
