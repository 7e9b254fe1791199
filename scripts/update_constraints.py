"""Write constraints.txt: the exact versions in .venv of every package pyproject.toml names.

pyproject.toml states what users may install (version ranges); constraints.txt pins what this project's own
set-up (scripts/setup.sh, CI) installs, so that every developer and CI run gets the same versions, and torch
stays the CPU build that lies on this machine (a plain `torch` would resolve a multi-GB CUDA build).

Run after changing a range in pyproject.toml or upgrading a package in .venv:
    .venv/bin/python scripts/update_constraints.py
"""
import os
import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    sys.exit("update_constraints.py needs Python 3.11+ (tomllib); run it with .venv/bin/python")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def main() -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    names = {_name(r) for r in reqs}
    names.add("mkdocstrings-python")  # mkdocstrings[python]: the extra's handler package
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    pins = {}
    for line in freeze:
        name, sep, version = line.partition("==")
        if sep and name.lower().replace("_", "-") in names:
            pins[name.lower().replace("_", "-")] = f"{name}=={version}"
    missing = sorted(names - set(pins))
    if missing:
        print(f"not installed in this venv (left out): {', '.join(missing)}", file=sys.stderr)
    if not pins.get("torch", "").endswith("+cpu"):
        sys.exit(f"torch in this venv is {pins.get('torch')!r}, not the CPU build; refusing to pin it")
    with open(os.path.join(ROOT, "constraints.txt"), "w") as f:
        f.write("# Exact versions for this project's own set-up (scripts/setup.sh passes -c constraints.txt) and CI:\n"
                "# what the extras of pyproject.toml resolved to on the development machine. Users installing\n"
                "# snapckpt get the ranges of pyproject.toml, not these pins.\n"
                "# torch is pinned to its CPU build (+cpu, from the machine's wheel directory): a plain `torch`\n"
                "# would resolve a multi-GB CUDA build.\n"
                "# Regenerate with: .venv/bin/python scripts/update_constraints.py\n")
        for name in sorted(pins):
            f.write(pins[name] + "\n")
    print(f"wrote {len(pins)} pins to constraints.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
