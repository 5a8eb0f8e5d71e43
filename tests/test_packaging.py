"""Shipped recipes by name, and what the wheel holds.

A recipe's name (``shapes/flow_grpo``) works wherever a run config is read, a file that exists
wins, and a mistyped name is one ``error:`` line naming close matches; ``diffalign recipes`` lists,
shows and locates the files. The wheel built from this tree holds every file of ``configs/`` and
``demo/`` (the same files, as ``diffalign._configs`` / ``diffalign._demo``) and every module, and
from the unpacked wheel alone, outside the checkout, the recipes and the demo still work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from diffalign import shipped
from diffalign.cli import main
from diffalign.config_files import read_yaml
from diffalign.errors import ConfigError

from tests.helpers.tiny_run import ROOT
SKIP = ("__pycache__", "*.pyc")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _files(folder: Path) -> list[Path]:
    """Every file under ``folder`` except Python's caches."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


# ---- name resolution ---------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["shapes/flow_grpo", "shapes/flow_grpo.yaml", "configs/shapes/flow_grpo.yaml"])
def test_a_recipe_name_resolves_outside_the_checkout(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert shipped.config_file(spelling) == shipped.root() / "shapes" / "flow_grpo.yaml"
    assert read_yaml(spelling)["algorithm"]["name"] == "flow_grpo"


def test_the_editable_install_reads_the_checkouts_configs_folder():
    # one copy of each file: the package diffalign._configs is configs/ itself
    assert shipped.root().resolve() == (ROOT / "configs").resolve()
    assert {r.name for r in shipped.available()} == {
        p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}


def test_a_file_that_exists_wins_over_the_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shapes").mkdir()
    (tmp_path / "shapes" / "flow_grpo.yaml").write_text("max_iterations: 3\n")
    assert shipped.config_file("shapes/flow_grpo.yaml") == Path("shapes/flow_grpo.yaml")
    assert read_yaml("shapes/flow_grpo.yaml") == {"max_iterations": 3}
    assert read_yaml("shapes/flow_grpo")["algorithm"]["name"] == "flow_grpo"  # no file of that name: the recipe
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):  # a folder of that name is what the user meant
        read_yaml("tiny")


def test_a_shipped_recipes_prompt_file_resolves_outside_the_checkout(tmp_path, monkeypatch):
    """The tiny editing recipes name configs/tiny/edit/prompts.jsonl: from another folder that is
    the shipped file (with its source images); a file of that path in the working folder wins."""
    from diffalign.config_files import load_config
    from diffalign.images import prompt_image
    from diffalign.prompts import resolve_prompts

    monkeypatch.chdir(tmp_path)
    shipped_file = shipped.root() / "tiny" / "edit" / "prompts.jsonl"
    assert shipped.data_file("configs/tiny/edit/prompts.jsonl") == shipped_file
    train, _ = resolve_prompts(load_config("tiny/flow_grpo_flux_kontext"))
    assert train and all(Path(prompt_image(p)).parent == shipped_file.parent for p in train)
    own = tmp_path / "configs" / "tiny" / "edit" / "prompts.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("{}")
    assert shipped.data_file("configs/tiny/edit/prompts.jsonl") == Path("configs/tiny/edit/prompts.jsonl")
    assert shipped.data_file("configs/no/such.jsonl") == Path("configs/no/such.jsonl")  # the reader says it is missing


def test_config_by_name_equals_config_by_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", str(ROOT / "configs" / "shapes" / "flow_grpo.yaml")]) == 0
    by_file = capsys.readouterr().out
    assert main(["config", "shapes/flow_grpo"]) == 0
    assert capsys.readouterr().out == by_file


@pytest.mark.parametrize("command, name", [
    ("train-spm", "shapes/spo"),  # an spo run config: the SPM recipe in algorithm.spm_train
    ("train-reward", "shapes/drm_step_grpo"),  # a drm_step_grpo run config: algorithm.drm_train
])
def test_the_judge_trainers_take_recipe_names(tmp_path, monkeypatch, capsys, command, name):
    monkeypatch.chdir(tmp_path)
    assert main([command, name, "bogus.key=1"]) == 2  # the recipe was read: the unknown key is the error
    assert "bogus" in _error_line(capsys)


@pytest.mark.parametrize("args", [["train", "shapes/flow_grp"], ["config", "shape/flow_grpo.yaml"],
                                  ["recipes", "show", "flow_grpo"]])
def test_a_mistyped_name_is_one_line_with_close_matches(tmp_path, monkeypatch, capsys, args):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    line = _error_line(capsys)
    assert "close matches: shapes/flow_grpo" in line and "diffalign recipes" in line, line


def test_an_absolute_path_that_does_not_exist_is_not_looked_up_as_a_recipe(tmp_path, capsys):
    missing = tmp_path / "shapes" / "flow_grpo.yaml"
    assert main(["config", str(missing)]) == 2
    assert _error_line(capsys) == f"error: config file {str(missing)!r} does not exist"


def test_a_name_outside_the_recipes_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "show", "../pyproject.toml"]) == 2  # names are looked up, never joined onto a path
    assert _error_line(capsys).startswith("error: unknown recipe '../pyproject.toml'")


# ---- diffalign recipes -------------------------------------------------------------------------
def test_recipes_lists_every_name_with_its_first_comment_line(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    *rows, footer = lines
    names = [row.split()[0] for row in rows]
    assert names == sorted(p.relative_to(ROOT / "configs").with_suffix("").as_posix()
                           for p in (ROOT / "configs").rglob("*.yaml"))
    described = {row.split()[0]: (row.split(None, 1) + [""])[1] for row in rows}
    first_line = (ROOT / "configs" / "shapes" / "flow_grpo.yaml").read_text().splitlines()[0]
    assert described["shapes/flow_grpo"] == first_line.lstrip("# ")
    # a leading line that shows the launch command is skipped: the description is the prose below it
    assert described["accelerate/ddp"].startswith("Data parallel on one node")
    assert "diffalign recipes show NAME > my.yaml" in footer


def test_description_is_the_first_prose_comment_line(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("# accelerate launch --config_file r.yaml -m diffalign.cli train CONFIG\n#\n# Two processes.\n# more\nk: 1\n")
    assert shipped.Recipe("r", f).description == "Two processes."
    f.write_text("k: 1\n# a comment below the first key\n")
    assert shipped.Recipe("r", f).description == ""


def test_recipes_show_prints_the_file_and_path_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "show", "accelerate/ddp"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "accelerate" / "ddp.yaml").read_text()
    assert main(["recipes", "path", "accelerate/ddp"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.is_absolute() and path.resolve() == (ROOT / "configs" / "accelerate" / "ddp.yaml").resolve()


@pytest.mark.parametrize("args, needle", [(["recipes", "show"], "needs a recipe NAME"),
                                          (["recipes", "list", "shapes/spo"], "takes no name")])
def test_recipes_usage_errors_are_one_line(capsys, args, needle):
    assert main(args) == 2
    assert needle in _error_line(capsys)


# ---- the wheel ---------------------------------------------------------------------------------
def _setuptools_table() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_dirs() -> set[str]:
    """Top-level folders the packages of pyproject.toml come from."""
    table = _setuptools_table()
    return {table["package-dir"].get(pkg, pkg.replace(".", "/")).split("/")[0] for pkg in table["packages"]}


def _in_wheel(path: Path) -> str:
    """Where a file of the tree lands in the wheel (configs/x -> diffalign/_configs/x)."""
    rel = path.relative_to(ROOT).as_posix()
    for package, folder in _setuptools_table()["package-dir"].items():
        if rel.startswith(folder + "/"):
            return package.replace(".", "/") + rel[len(folder):]
    return rel


def build_wheel(tmp: Path) -> tuple[Path, str]:
    """A wheel built from a copy of the tree (the build's own folders stay out of the checkout) by
    setuptools' build backend, as ``pip wheel --no-build-isolation`` calls it, with every Python
    warning shown; returns the wheel and the build's output."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for name in _source_dirs():
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns(*SKIP))
    build = f"from setuptools import build_meta; build_meta.build_wheel({str(tmp)!r})"
    result = subprocess.run([sys.executable, "-W", "always", "-c", build], cwd=src, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    (built,) = tmp.glob("diffalign-*.whl")
    return built, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory) -> tuple[Path, str]:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def wheel(wheel_build) -> Path:
    return wheel_build[0]


def test_the_wheel_ships_the_license_and_the_build_does_not_warn(wheel_build):
    """pyproject.toml's license is an SPDX expression with its file (PEP 639): the wheel's metadata
    names it, the wheel holds LICENSE, and setuptools warns about nothing (a ``license = {text}``
    table drew three deprecation warnings per build)."""
    import setuptools

    import diffalign

    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == diffalign.__license__ == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    (needed,) = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = tuple(int(x) for x in needed.split(">=")[1].split("."))
    assert minimum >= (77,)  # the first setuptools that reads license-files and an SPDX license
    assert tuple(int(x) for x in setuptools.__version__.split(".")[:len(minimum)]) >= minimum  # this build's own

    wheel, log = wheel_build
    archive = zipfile.ZipFile(wheel)
    assert archive.read("diffalign-0.1.0.dist-info/licenses/LICENSE").decode() == license_text
    metadata = archive.read("diffalign-0.1.0.dist-info/METADATA").decode().split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    warnings = [line for line in log.splitlines() if "Warning:" in line]  # Python's "Category: message"
    assert not warnings, warnings


def test_the_wheel_holds_every_config_demo_and_module_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _files(ROOT / "configs") + _files(ROOT / "demo") + _files(ROOT / "diffalign" / "assets")
    expected += _files(ROOT / "diffalign" / "planner" / "architectures") + [ROOT / "diffalign" / "planner" / "activations.json"]
    expected += [p for top in ("diffalign", "reward_models", "schedulers") for p in (ROOT / top).rglob("*.py")
                 if "__pycache__" not in p.parts]
    missing = sorted(_in_wheel(p) for p in expected if _in_wheel(p) not in names)
    assert not missing, f"the wheel lacks {missing}"
    assert "diffalign/_configs/shapes/flow_grpo.yaml" in names and "diffalign/_demo/app.py" in names
    assert not any(n.startswith(("configs/", "demo/")) for n in names)  # no generic top-level names in site-packages


def test_the_unpacked_wheel_alone_serves_recipes_and_the_demo(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    away = tmp_path / "elsewhere"  # a folder outside any checkout
    away.mkdir()
    script = (
        "import diffalign, diffalign.shipped as s, diffalign._demo.app as app\n"
        "from diffalign.cli import main\n"
        "print('package', diffalign.__file__); print('recipes', s.root()); print('demo', app.__file__)\n"
        "assert main(['recipes']) == 0\n"
        "assert main(['config', 'shapes/flow_grpo']) == 0\n"
        "from diffalign.config_files import load_config; from diffalign.prompts import resolve_prompts\n"
        "assert resolve_prompts(load_config('tiny/flow_grpo_qwen_edit'))[0]  # a shipped prompt file with images\n"
        "main(['demo', '--help'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=away, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ", 1)[0] in ("package", "recipes", "demo"))
    assert Path(out["package"]).is_relative_to(site) and Path(out["recipes"]) == site / "diffalign" / "_configs"
    assert Path(out["demo"]) == site / "diffalign" / "_demo" / "app.py"
    assert "shapes/flow_grpo " in result.stdout and "algorithm:\n  name: flow_grpo" in result.stdout
    assert "--share" in result.stdout and "usage: diffalign demo" in result.stdout


def test_the_wheel_installs_three_top_level_packages_and_refuses_a_stand_in(wheel, tmp_path):
    """diffalign, reward_models and schedulers (docs/architecture.md, "Packages": the last two are
    public API under their own names). A folder ``schedulers/`` in the working folder, which
    ``python -m`` puts first on sys.path, stops diffalign at import with a message naming it."""
    archive = zipfile.ZipFile(wheel)
    assert archive.read("diffalign-0.1.0.dist-info/top_level.txt").decode().split() == ["diffalign", "reward_models", "schedulers"]
    assert {n.split("/")[0] for n in archive.namelist() if not n.startswith("diffalign-0.1.0")} == {
        "diffalign", "reward_models", "schedulers"}
    site = tmp_path / "site"
    archive.extractall(site)
    project = tmp_path / "project"  # another project whose learning-rate schedulers are a package "schedulers"
    (project / "schedulers").mkdir(parents=True)
    (project / "schedulers" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "diffalign.cli", "list"], cwd=project, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "needs its own top-level package 'schedulers'" in last and str(project / "schedulers") in last, last
    (project / "schedulers" / "__init__.py").unlink()
    (project / "schedulers").rmdir()
    result = subprocess.run([sys.executable, "-m", "diffalign.cli", "list"], cwd=project, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "rewards:" in result.stdout, result.stderr[-2000:]


@pytest.mark.slow
def test_from_the_wheel_the_main_job_exports_a_model_diffusers_loads(wheel, tmp_path):
    """From the unpacked wheel alone, outside the checkout, as a user runs it: two iterations of the
    main job (``shapes/flow_grpo``, a full fine-tune of the shipped model, with a small rollout and
    evaluation), ``diffalign export RUN`` with no options, and the model card's own loading code in a
    Python without diffalign: it draws an image. The card's metadata survives the Hub's round trip
    and names the license of the LICENSE file."""
    import yaml
    from huggingface_hub import ModelCard, ModelCardData

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")

    def diffalign(*args):
        result = subprocess.run([sys.executable, "-m", "diffalign.cli", *args], cwd=away, env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    small = ["max_iterations=2", "rollout.prompts_per_iteration=2", "rollout.group_size=2", "train.batch_size=4",
             "eval.images_per_family=1", "eval.probe=false", "log.progress_bar=false"]
    diffalign("train", "shapes/flow_grpo", "output_dir=run", *small)
    out = diffalign("export", "run")
    folder = away / "run" / "export" / "merged"
    assert out.strip().splitlines()[-1] == f"exported merged weights to {Path('run') / 'export' / 'merged'}"
    assert (folder / "pipeline.py").read_bytes() == (site / "diffalign" / "shapes" / "pipeline.py").read_bytes()

    text = (folder / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert ModelCardData(**front).to_dict() == front and ModelCard.load(folder / "README.md").data.to_dict() == front
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    license_id = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert front["license"] == license_id.lower() == "apache-2.0" and front["library_name"] == "diffusers"
    assert "Apache License" in (site / "diffalign-0.1.0.dist-info" / "licenses" / "LICENSE").read_text()
    assert ("`shapes` (the ShapesWorld text-to-image model shipped in the diffalign package) with all of its "
            "weights fine-tuned with **flow_grpo**") in text

    code = text.split("```python\n", 1)[1].split("```", 1)[0].replace("num_inference_steps=20", "num_inference_steps=2")
    assert "DiffusionPipeline.from_pretrained(\".\", trust_remote_code=True)" in code and "diffalign" not in code
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    plain["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    script = "import sys; sys.modules['diffalign'] = None  # a diffusers user without diffalign\n" + code + \
             "print('image', image.size)\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=folder, env=plain, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "image (32, 32)" in result.stdout
    assert "might require the following packages" not in result.stderr  # the code in the folder imports no diffalign
