"""The examples of README.md, of every page of docs/ and of benchmarks/README.md work for a
newcomer, checked without running them: every `decoderlm` command line (also under torchrun or
`python -m decoderlm`) parses with the real command's flags and values; every `benchmarks/`
script exists and takes the flags given; every path given to a path flag exists in a fresh
clone or is made by an earlier command (`--out DIR`, a run's default `runs/NAME`, `mkdir`,
`cp`, `> FILE`, a settings file shown as `# NAME.yaml:` at the top of a block), and so is every
file a shell command (`cp`, `head`, `sed`, `tail`, `cat`) or a Python example's `open` reads;
`path/to/` marks a path of the reader's. Nothing is downloaded (`curl -o`), except in
benchmarks/README.md, whose figures compare against other projects' data. A `decoderlm train`
without --out whose `runs/NAME` is taken writes `runs/NAME-2`, so a later command naming
`runs/NAME` would read another run: that is a problem too. Each page is read after the README,
on its own: it may use what the README's commands make and must make the rest itself. Every
Python example compiles and every name it imports from decoderlm exists.

The README's commands, then data.md's data examples, are also run for real in a scratch copy
of a fresh clone with no network, with tiny model and step settings added.
"""

import ast
import contextlib
import importlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from decoderlm.cli import COMMANDS, parse

from conftest import SMOLLM2_GGUF, needs_smollm2

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _in_a_fresh_clone() -> set[str]:
    """The files git tracks and their folders: what a fresh clone holds (a reader's own runs
    and data, made by following the pages, are not in it)."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return {str(parent) for f in files for parent in [Path(f), *Path(f).parents]} - {"."}


IN_A_FRESH_CLONE = _in_a_fresh_clone()
# the pages read after the README: the guide and the benchmarks' figures
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "benchmarks" / "README.md"]
PATH_FLAGS = {
    "--data",
    "--run",
    "--resume",
    "--config",
    "--model-config",
    "--hf",
    "--gguf",
    "--prompt-file",
    "--init-from",
    "--text-file",
}
OPERATORS = {"&&", "||", ";", "|", "&"}
SMOLLM2_VAR = "$SMOLLM2"  # docs/open-models.md's name for the installed SmolLM2 GGUF file
READERS = {"cp", "head", "sed", "tail", "cat"}  # shell commands whose path arguments are read
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SETTINGS_FILE = re.compile(r"#\s*(\S+\.(?:ya?ml|json|toml))\s*:")


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return BLOCK.findall(text)


def shell_commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: words, with `> FILE` kept as two words; lines
    ending in a backslash are joined; comments dropped."""
    commands: list[list[str]] = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in OPERATORS:
                commands.append(words)
                words = []
            else:
                words.append(word)
        commands.append(words)
    return [c for c in commands if c]


def decoderlm_argv(words: list[str]) -> list[str] | None:
    """The arguments after `decoderlm` of a command line that runs decoderlm, else None."""
    if words[0] == "decoderlm":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "decoderlm":
            return words[i + 2 :]
    return None


class Walk:
    """A page's commands in order, with the paths made so far and the problems found;
    `downloads`: whether `curl -o` may fetch a file (only benchmarks/README.md)."""

    def __init__(self, made: set[str] | None = None, downloads: bool = False):
        self.made: set[str] = set(made or ())
        self.problems: list[str] = []
        self.downloads = downloads
        self.stale: dict[str, str] = {}  # runs/NAME -> the train line that wrote runs/NAME-2

    def known(self, path: str) -> bool:
        clean = path.rstrip("/")
        if "path/to/" in path or path.startswith(SMOLLM2_VAR):  # the reader's, or installed
            return True
        stale = next((p for p in self.stale if clean == p or clean.startswith(p + "/")), None)
        if stale:
            self.problems.append(
                f"{path}: `{self.stale[stale]}` wrote {stale}-2, not {stale}; give it --out"
            )
            return True
        if str(Path(clean)) in IN_A_FRESH_CLONE:  # in the repository itself, not beside it
            return True
        return any(clean == p or clean.startswith(p + "/") for p in self.made)

    def shell(self, words: list[str]) -> None:
        for i, word in enumerate(words[:-1]):
            if words[0] == "curl" and word in ("-o", "--output"):
                if not self.downloads:
                    self.problems.append(f"{shlex.join(words)}: a download; use the shipped data")
                self.made.add(words[i + 1].rstrip("/"))
        self.reads_and_makes(words)
        words = words[: words.index(">")] if ">" in words else words
        argv = decoderlm_argv(words)
        if argv is not None:
            self.decoderlm(argv, shlex.join(words))
        elif (
            len(words) > 1 and words[0].startswith("python") and words[1].startswith("benchmarks/")
        ):
            self.benchmark(words[1], words[2:])

    def reads_and_makes(self, words: list[str]) -> None:
        """Check the files a file command reads; record what it and `> FILE` make."""
        target = words[words.index(">") + 1] if ">" in words[:-1] else None
        args = (words[: words.index(">")] if target else words)[1:]
        args = [w for w in args if not w.startswith("-") and not w.startswith("+")]
        if words[0] == "sed" and args:
            args = args[1:]  # the script
        if words[0] == "cp" and len(args) >= 2:
            target, args = args[-1], args[:-1]
        if words[0] in READERS:
            for path in (a for a in args if "/" in a or "." in a):
                if not self.known(path):
                    self.problems.append(f"{shlex.join(words)}: {path} is not in a fresh clone")
        if words[0] == "mkdir":
            self.made.update(w.rstrip("/") for w in args)
        if target:
            self.made.add(target.rstrip("/"))

    def decoderlm(self, argv: list[str], line: str) -> None:
        if not argv or (argv[0] not in COMMANDS and argv[0] not in ("--version", "--help")):
            self.problems.append(f"{line}: no such decoderlm command")
            return
        parse_argv = []
        i = 0
        while i < len(argv):
            flag = argv[i].split("=", 1)[0]
            value = argv[i].split("=", 1)[1] if "=" in argv[i] else None
            if flag in PATH_FLAGS:
                value = value if value is not None else argv[i + 1]
                if not self.known(value):
                    self.problems.append(
                        f"{line}: {flag} {value} is neither in the repository "
                        f"nor made by an earlier README command"
                    )
                skip = 1 if "=" in argv[i] else 2
                if flag == "--config" and not (ROOT / value).is_file():  # shown in a block
                    i += skip
                    continue
                parse_argv += argv[i : i + skip]
                i += skip
                continue
            parse_argv.append(argv[i])
            i += 1
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # --help, --version
                command, given = parse(parse_argv)
        except SystemExit as e:  # --help, --version
            if e.code != 0:
                self.problems.append(f"{line}: exits {e.code}")
            return
        except Exception as e:  # noqa: BLE001 - every parse error is a README problem
            self.problems.append(f"{line}: {str(e).splitlines()[0]}")
            return
        self.record_outputs(command, given, line)

    def record_outputs(self, command: str, given: dict, line: str = "") -> None:
        out = given.get("out")
        if out:
            self.made.add(str(out).rstrip("/"))
        elif command == "inspect":  # report.html here, never replaced unless named
            if "report.html" in self.made:
                self.problems.append(f"{line}: report.html is already there; give --out")
            self.made.add("report.html")
        elif command == "train" and not given.get("resume"):
            name = "finetune" if given.get("init_from") else given.get("preset") or "default"
            run = f"runs/{name}"
            if run in self.made:
                self.stale[run] = line
            self.made.add(run)

    def benchmark(self, script: str, args: list[str]) -> None:
        path = ROOT / script
        if not path.is_file():
            self.problems.append(f"{script}: no such benchmark script")
            return
        source = path.read_text(encoding="utf-8")
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and f'"{flag}"' not in source:
                self.problems.append(f"{script} {' '.join(args)}: {flag} is not one of its flags")
            if flag == "--data" and "=" not in arg:
                value = args[args.index(arg) + 1]
                if not self.known(value):
                    self.problems.append(f"{script}: --data {value} is not made by the README")


def python_problems(body: str) -> list[str]:
    """What is wrong with a Python example: a syntax error, or a name imported from decoderlm
    that does not exist (the example is compiled and its imports resolved, not run)."""
    try:
        tree = ast.parse(body)
    except SyntaxError as e:
        return [f"python example: {e}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decoderlm"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                problems.append(f"python example: no module {node.module}")
                continue
            problems += [
                f"python example: {node.module} has no {alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("decoderlm"):
                    try:
                        importlib.import_module(alias.name)
                    except ImportError:
                        problems.append(f"python example: no module {alias.name}")
    return problems


def python_reads(body: str) -> list[str]:
    """The files a Python example opens for reading: the literal first argument of each
    `open(...)` whose mode (if given) does not write."""
    paths = []
    for node in ast.walk(ast.parse(body)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open" and node.args:
            mode = node.args[1] if len(node.args) > 1 else None
            writes = isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+")
            if isinstance(node.args[0], ast.Constant) and not writes:
                paths.append(str(node.args[0].value))
    return paths


def walk(text: str, made: set[str] | None = None, downloads: bool = False) -> Walk:
    """Read a page's blocks in order, starting from the paths in `made`; `downloads`: see
    Walk."""
    state = Walk(made, downloads)
    for language, body in readme_blocks(text):
        if language == "python":
            problems = python_problems(body)
            state.problems += problems
            if not problems:
                for path in python_reads(body):
                    if not state.known(path):
                        state.problems.append(f"python example: opens {path}, not in a clone")
        elif language in ("yaml", "yml", "json", "toml"):
            match = SETTINGS_FILE.match(body.strip())
            if match:
                state.made.add(match.group(1))
        elif language in ("bash", "sh", "shell", "console"):
            for words in shell_commands(body):
                state.shell(words)
    return state


def test_every_readme_command_parses_and_its_paths_exist_or_are_made_before():
    state = walk(README.read_text(encoding="utf-8"))
    assert not state.problems, "\n".join(state.problems)


@pytest.fixture(scope="module")
def made_by_readme() -> set[str]:
    return walk(README.read_text(encoding="utf-8")).made


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_of_a_page_parses_after_the_readme(page, made_by_readme):
    downloads = page == ROOT / "benchmarks" / "README.md"  # nanoGPT's data, for comparison
    state = walk(page.read_text(encoding="utf-8"), made_by_readme, downloads)
    assert not state.problems, "\n".join(state.problems)


def test_the_pages_are_there_and_none_points_outside_the_repository():
    names = {p.name for p in PAGES if p.parent.name == "docs"}
    assert {"index.md", "training.md", "data.md", "models.md", "sampling.md", "lens.md"} <= names
    assert {"finetune.md", "huggingface.md", "testing.md"} <= names
    for page in [README, *PAGES]:
        assert "../shared" not in page.read_text(encoding="utf-8"), page


@pytest.mark.parametrize(
    "example,problem",
    [
        ("decoderlm train --n-layerz 2", "n-layerz"),
        ("decoderlm trian", "no such decoderlm command"),
        ("decoderlm sample --run runs/nowhere", "runs/nowhere"),
        ("decoderlm train --data ../shared/data/x.txt", "../shared"),  # not in a fresh clone
        ("decoderlm eval --run runs/x --split test", "split"),
        ("python benchmarks/nowhere.py", "no such benchmark"),
        ("python benchmarks/train_speed.py --parts all", "--parts is not one of its flags"),
        ("torchrun --nproc_per_node 2 -m decoderlm train --dtyp bf16", "dtyp"),
        ("curl -L -o data/input.txt https://example.com/input.txt", "a download"),
        ("head -n 3 data/nowhere.txt > data/x.txt", "data/nowhere.txt is not in a fresh clone"),
        ("cp data/nowhere.txt data/input.txt", "data/nowhere.txt is not in a fresh clone"),
        (
            "decoderlm inspect --run tests/fixtures/run_v0 --text a --out report.html\n"
            "decoderlm inspect --run tests/fixtures/run_v0 --text b",
            "report.html is already there; give --out",
        ),
        (
            "decoderlm train\ndecoderlm train --log csv\ndecoderlm eval --run runs/default",
            "`decoderlm train --log csv` wrote runs/default-2, not runs/default; give it --out",
        ),
    ],
)
def test_the_checker_finds_a_drifted_example(example, problem):
    state = walk(f"```bash\n{example}\n```\n")
    assert state.problems and problem in state.problems[0], state.problems


@pytest.mark.parametrize(
    "example,problem",
    [
        ("from decoderlm import DecoderLN", "decoderlm has no DecoderLN"),
        ("from decoderlm.model.hooks import hook", "decoderlm.model.hooks has no hook"),
        ("import decoderlm.nowhere", "no module decoderlm.nowhere"),
        ("from decoderlm.nowhere import x", "no module decoderlm.nowhere"),
        ("x = (", "python example"),
        ('text = open("data/input.txt").read()', "opens data/input.txt, not in a clone"),
    ],
)
def test_the_checker_finds_a_drifted_python_example(example, problem):
    state = walk(f"```python\n{example}\n```\n")
    assert state.problems and problem in state.problems[0], state.problems


def test_a_page_starts_from_what_the_readme_made():
    page = "```bash\ndecoderlm sample --run runs/default\n```\n"
    assert walk(page, {"runs/default"}).problems == []
    assert "runs/default" in walk(page).problems[0]


def test_the_checker_follows_what_earlier_commands_make():
    text = (
        "```bash\nmkdir -p data/x\nhead -n 3 README.md > data/x/train.txt\n"
        "decoderlm prepare --data data/x --out data/x-char\n"
        "decoderlm train --data data/x-char --out runs/x\ndecoderlm sample --run runs/x\n"
        "decoderlm train --preset seed-notebook\ndecoderlm eval --run runs/seed-notebook\n```\n"
        "```yaml\n# mine.yaml: decoderlm train --config mine.yaml\nmax_steps: 3\n```\n"
        "```bash\ndecoderlm train --config mine.yaml \\\n   --max-steps 4   # a comment\n```\n"
    )
    state = walk(text)
    assert not state.problems, state.problems
    assert {"data/x", "data/x-char", "runs/x", "runs/seed-notebook", "mine.yaml"} <= state.made
    copied = "```bash\nmkdir -p d\ncp README.md d/in.txt\nsed -n 1,2p d/in.txt > d/two.txt\n```\n"
    opened = '```python\nopen("d/two.txt").read()\nopen("d/new.txt", "w").write("x")\n```\n'
    assert walk(copied + opened).problems == []
    assert (
        walk("```bash\ncurl -o data/x.txt https://example.com\n```\n", downloads=True).problems
        == []
    )


# --- the examples run -------------------------------------------------------------------------

# added after each command's own flags (the last value of a flag wins): a model and a run
# small enough that the README's commands take seconds
TINY_MODEL = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--block-size", "16"]
TINY_STEPS = ["--batch-size", "4", "--max-steps", "2", "--eval-interval", "2", "--no-progress"]
TINY_STEPS += ["--sample-chars", "20"]
TINY = {"sample": ["--max-new-tokens", "4"], "inspect": ["--max-tokens", "8"]}
RUN_COMMANDS = {"train", "prepare", "sample", "eval", "inspect", "merge", "params", "presets"}
FILE_COMMANDS = {"mkdir", "cp", "head", "sed", "tail", "cat"}
SKIPPED_FLAGS = {"--help", "--nproc-per-node", "--hf", "--compile"}  # needs more than a CPU


def tiny_argv(argv: list[str]) -> list[str] | None:
    """A README command with the tiny settings added, or None for one not run here (serve,
    --help, several processes, a path of the reader's)."""
    if not argv or argv[0] not in RUN_COMMANDS or any("path/to/" in a for a in argv):
        return None
    if SKIPPED_FLAGS & {a.split("=")[0] for a in argv}:
        return None
    if argv[0] == "train":  # a fine-tune keeps its base's shape
        return argv + (TINY_STEPS if "--init-from" in argv else TINY_MODEL + TINY_STEPS)
    return argv + TINY.get(argv[0], [])


def run_page(text: str, where: Path) -> list[str]:
    """Run a page's file commands, its decoderlm commands (tiny) and its Python examples in
    `where`; returns what failed."""
    from decoderlm.cli import main

    failures = []
    for language, body in readme_blocks(text):
        if language == "python":
            try:
                exec(compile(body, "example", "exec"), {})
            except Exception as e:  # noqa: BLE001 - any failure is the example's
                failures.append(f"python example: {type(e).__name__}: {e}")
            continue
        for words in shell_commands(body) if language in ("bash", "sh") else []:
            argv = decoderlm_argv(words)
            if argv is not None and (tiny := tiny_argv(argv)) is not None:
                if main(tiny) != 0:
                    failures.append(f"decoderlm {shlex.join(tiny)} failed")
            elif words[0] in FILE_COMMANDS:
                line = shlex.join(words).replace(" '>' ", " > ")
                done = subprocess.run(["bash", "-c", line], cwd=where, capture_output=True)
                if done.returncode:
                    failures.append(f"{line}: {done.stderr.decode().strip()}")
    return failures


def test_the_readme_runs_from_a_fresh_clone_offline_then_the_data_examples(
    tmp_path, monkeypatch, capsys
):
    # a scratch folder holding the tracked files (linked), as a fresh clone does, and no
    # network: every connection is refused
    import socket

    for top in {Path(f).parts[0] for f in IN_A_FRESH_CLONE}:
        (tmp_path / top).symlink_to(ROOT / top)

    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    failures = run_page(README.read_text(encoding="utf-8"), tmp_path)
    data_page = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    failures += run_page(data_page.split("## Evaluating a run")[0], tmp_path)  # the data part
    capsys.readouterr()
    assert not failures, "\n".join(failures)
    assert (tmp_path / "runs" / "wiki-merged" / "model.safetensors").is_file()
    assert (tmp_path / "data" / "input-char" / "meta.json").is_file()


def test_pages_run_one_after_another_never_make_the_same_path_twice():
    """A reader who follows the README and then every page in order makes each `--out` path
    once: a second `decoderlm train` or `prepare` with the same --out stops with "already
    exists" (inspect's HTML file is replaced, so it may repeat)."""
    made = {}
    for page in [README, *PAGES]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for out in re.findall(r"--out (\S+)", block):
                if out.endswith(".html") or "/to/" in out or out == "DIR":
                    continue
                assert out not in made, f"{page.name} and {made[out]} both make {out}"
                made[out] = page.name


@needs_smollm2
def test_the_open_models_worked_example_runs_on_smollm2(tmp_path, monkeypatch, capsys):
    """docs/open-models.md's SmolLM2 commands, run for real with $SMOLLM2 the installed file
    (skipped, saying how to install it, without the package): sample, inspect, eval, a LoRA
    fine-tune, merge, export and a sample of the export."""
    from decoderlm.cli import main

    for top in {Path(f).parts[0] for f in IN_A_FRESH_CLONE}:
        (tmp_path / top).symlink_to(ROOT / top)
    monkeypatch.chdir(tmp_path)
    page = (ROOT / "docs" / "open-models.md").read_text(encoding="utf-8")
    body = readme_blocks(page.split("## A worked example")[1])[1][1]
    ran = []
    for words in shell_commands(body):
        words = [w.replace(SMOLLM2_VAR, str(SMOLLM2_GGUF)) for w in words]
        argv = decoderlm_argv(words)
        if argv is not None:
            assert main(argv) == 0, shlex.join(argv)
            ran.append(argv[0])
        elif words[0] in FILE_COMMANDS:
            line = shlex.join(words).replace(" '>' ", " > ")
            subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True)
    assert ran == ["sample", "inspect", "eval", "train", "merge", "export", "sample"]
    out = capsys.readouterr().out
    assert "Paris" in out and "bits/byte" in out
    assert (tmp_path / "smollm2-hf" / "model.safetensors").is_file()
