"""The client corpus: each program as a user would launch it, and how it is estimated (one place, for the tests
in tests/test_corpus.py and for scripts/corpus_figures.py)."""
from dataclasses import dataclass, field
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Program:
    name: str
    script: str
    args: tuple[str, ...] = ()
    launcher: tuple[str, ...] = ("python",)  # torchrun ... for the multi-process ones
    options: dict = field(default_factory=dict)  # more keyword arguments of run_trace (device_count ...)

    def command(self) -> list[str]:
        return [*self.launcher, str(CORPUS_DIR / self.script), *self.args]


TORCHRUN_2 = ("torchrun", "--nproc_per_node=2")
PROGRAMS = {p.name: p for p in [
    Program("hf_trainer", "hf_trainer.py"),
    Program("peft_lora", "peft_lora.py"),
    Program("lightning_trainer", "lightning_trainer.py"),
    Program("fabric_1", "fabric_train.py", ("--devices", "1")),
    Program("fabric_2_ddp", "fabric_train.py", ("--devices", "2"), options={"device_count": 2}),
    Program("timm_amp", "timm_train.py"),
    Program("accelerate_bf16", "accelerate_train.py"),
    Program("ddp_torchrun_2", "ddp_torchrun.py", launcher=TORCHRUN_2),
    Program("fsdp2_torchrun_2", "fsdp2_torchrun.py", launcher=TORCHRUN_2),
    Program("lstm_lm_sgd", "lstm_lm.py", ("--update", "sgd")),
    Program("lstm_lm_by_hand", "lstm_lm.py", ("--update", "by-hand")),
    Program("example_loop", "example_loop.py"),
]}
ITERATIONS = 3  # optimizer steps traced per program
