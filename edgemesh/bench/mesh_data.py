"""What ``bench mesh --job FILE`` trains on: a user's job file and glyph image folders drawn for it.

The job is the user's own file (its ``[model]`` layer list, its ``[data]`` and ``[evaluation]`` paths, its learning
rate); the benchmark only sets what makes the three modes comparable (``job_text``). Its images are drawn glyphs
(:mod:`edgemesh.bench.glyphs`) written where the job reads them: the job's i-th class is the i-th glyph, each
device's folder is ``<device's data dir>/<data.path>/<class>/`` with a class mix of its own (``device_mixes``: two
classes twice as many, the last device lacking one), the single board's folder is every device's images pooled
(one board holding the fleet's data), and the held-out folder is ``<ps.data_dir>/<evaluation.path>/`` with every
class evenly.
"""

from __future__ import annotations

import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemesh.bench.glyphs import GLYPHS, SIZE, device_mixes, draw_glyphs
from edgemesh.common.errors import ConfigError
from edgemesh.common.jobs import render_job

POOLED = "pooled"
"""The data directory of the single board: every device's images."""
HELD_OUT = "ps"
"""The parameter server's data directory (``ps.data_dir``)."""
HELD_OUT_SEED = 1000


@dataclass(frozen=True, slots=True)
class UserJob:
    """The user's job file, as tables, with what the benchmark reads of it."""

    tree: dict[str, Any]
    source: Path

    @classmethod
    def read(cls, path: Path) -> UserJob:
        """The job file at ``path``; ConfigError when the benchmark cannot draw its data: not an image folder of
        3x32x32 images, more classes than glyphs, or no held-out folder."""
        try:
            tree = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--job {path}: {exc}") from None
        model, data, evaluation = tree.get("model", {}), tree.get("data", {}), tree.get("evaluation", {})
        problems = []
        if data.get("format") != "image-folder" or not data.get("path"):
            problems.append('[data] must be format = "image-folder" with a path (the glyphs are drawn there)')
        if list(model.get("input_shape", [])) != [3, SIZE, SIZE]:
            problems.append(f"[model] input_shape must be [3, {SIZE}, {SIZE}] (the glyphs are {SIZE}x{SIZE} RGB)")
        if not 2 <= len(model.get("classes", [])) <= len(GLYPHS):
            problems.append(f"[model] needs 2 to {len(GLYPHS)} classes (one glyph each)")
        if not evaluation.get("path"):
            problems.append("[evaluation] needs a path (the held-out folder on the parameter server's host)")
        if problems:
            raise ConfigError(f"--job {path}: " + "; ".join(problems))
        return cls(tree, path)

    @property
    def name(self) -> str:
        return str(self.tree.get("job", {}).get("name") or self.source.stem)

    @property
    def classes(self) -> list[str]:
        return [str(c) for c in self.tree["model"]["classes"]]

    @property
    def batch_size(self) -> int:
        return int(self.tree.get("training", {}).get("batch_size", 32))

    @property
    def lr(self) -> float:
        return float(self.tree.get("training", {}).get("lr", 0.05))

    def with_model(self, name: str, layers: list[Any]) -> UserJob:
        """The same job with another layer list (the benchmark's model that does not fit one Pi 3)."""
        tree = {section: dict(table) for section, table in self.tree.items()}
        tree["job"] = {**tree.get("job", {}), "name": name}
        tree["model"] = {**tree["model"], "layers": layers}
        tree["model"].pop("entry_point", None)
        return UserJob(tree, self.source)


def job_text(job: UserJob, *, name: str, training: dict[str, Any], planner: dict[str, Any], versions: int,
             eval_every: int) -> str:
    """The user's job as one run submits it: renamed, stopped ``versions`` past what the run waits for (the
    benchmark stops the fleet itself), evaluated every ``eval_every`` versions at any cost (``ps.eval_budget`` 1:
    every mode at the same versions), with the run's ``training`` and ``planner`` settings over the file's."""
    tree = {section: dict(table) for section, table in job.tree.items() if isinstance(table, dict)}
    tree["job"] = {"name": name, "description": str(tree.get("job", {}).get("description", "")),
                   "target_accuracy": 0.0, "max_versions": versions, "max_minutes": 0.0}
    tree["evaluation"] = {**tree["evaluation"], "every": eval_every}
    tree["training"] = {**tree.get("training", {}), **training}
    tree["planner"] = {**tree.get("planner", {}), **planner}
    tree["ps"] = {**tree.get("ps", {}), "eval_budget": 1.0}
    order = ("job", "model", "data", "evaluation", "training", "planner", "ps", "compressor")
    return render_job({s: tree[s] for s in order if s in tree})


def draw_folders(root: Path, job: UserJob, fleet: list[str], *, per_class: int, held_out_per_class: int,
                 others: list[str] | None = None) -> dict[str, Any]:
    """Each device's folder under ``root/<device>``, the pooled one (the ``fleet``'s images) under ``root/pooled`` and
    the held-out one under ``root/ps``, where the job reads them; ``others`` (devices of another run) get mixes of
    their own; what each holds, by class."""
    data_path, eval_path = job.tree["data"]["path"], job.tree["evaluation"]["path"]
    glyph_of = dict(zip(job.classes, GLYPHS, strict=False))
    class_of = {g: c for c, g in glyph_of.items()}
    mixes = {d: {class_of[g]: n for g, n in mix.items() if g in class_of}
             for group in (fleet, others or []) for d, mix in device_mixes(group, per_class).items()}
    for i, device in enumerate(mixes):
        _draw(root / device / data_path, {glyph_of[c]: n for c, n in mixes[device].items()}, class_of, seed=i)
        if device not in fleet:
            continue
        for folder in (root / device / data_path).iterdir():  # the pooled folder: every device's images
            target = root / POOLED / data_path / folder.name
            target.mkdir(parents=True, exist_ok=True)
            for image in folder.iterdir():
                shutil.copyfile(image, target / f"{device}-{image.name}")
    held_out = dict.fromkeys(job.classes, held_out_per_class)
    _draw(root / HELD_OUT / eval_path, {glyph_of[c]: n for c, n in held_out.items()}, class_of, seed=HELD_OUT_SEED)
    pooled = {c: sum(mixes[d].get(c, 0) for d in fleet) for c in job.classes}
    return {"classes": job.classes, "glyphs": glyph_of, "image_size": [3, SIZE, SIZE], "devices": mixes,
            "single_board": pooled, "held_out": held_out}


def _draw(folder: Path, counts: dict[str, int], class_of: dict[str, str], *, seed: int) -> None:
    """``counts`` glyphs drawn into ``folder/<class>/`` (each glyph under its class's name)."""
    scratch = folder.with_name(folder.name + ".drawing")
    draw_glyphs(scratch, counts, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    for glyph in counts:
        (scratch / glyph).rename(folder / class_of[glyph])
    scratch.rmdir()
