#!/usr/bin/env bash
# Mutation testing of one module or folder against the tests that cover it (mutmut 3, the `mutation`
# extra): run it before landing a change to that module; docs/testing.md keeps the last results.
#
#   scripts/mutation.sh MODULE [TEST ...]        e.g. scripts/mutation.sh src/shardfc/checkpoint
#   scripts/mutation.sh src/shardfc/train/observe/phases.py tests/train/observe/test_phases.py
#
# MODULE: a .py file or a folder under src/shardfc (the `src/` may be left out). TEST: pytest
# arguments selecting the tests to run (paths, `-k EXPR`); without them, tests/<same path>/test_<name>.py
# for a file if there is one, else tests/<same folder>.
#
# The run happens in .mutation/<module>/ (git-ignored): a copy of the repository's files whose
# pyproject.toml carries this module's [tool.mutmut], so the repository's own pyproject.toml is
# never changed and two modules can be run side by side. mutmut keeps its results there: a rerun
# tests only the mutants of functions that changed. Afterwards, in that folder:
#   mutmut results          the mutants that survived (or all: --all true)
#   mutmut show NAME        one mutant's diff
#   mutmut run NAME...      rerun some (globs allowed) after adding a test (sources are not
#                           recopied: run this script again instead once the code changed)
#
# Environment: PYTHON (default: python), MUTMUT (default: mutmut beside $PYTHON, else on PATH),
# JOBS (default: the number of CPUs), FRESH=1 to forget the previous results of this module,
# MUTANTS="GLOB ..." to (re)run only those mutants (e.g. after adding a test: the names survivors had,
# "shardfc.checkpoint.format.x_short_repr*"), LAUNCH_TIMEOUT_S (default 30): the longest a world that
# launch.spawn starts in a test's process waits in a collective (tests' own timeouts are minutes; a
# mutant that leaves a rank out of a collective would hold its world that long).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
fi

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
module=${1%/}
shift
[[ $module == src/* ]] || module=src/$module
[[ -e $module ]] || module=src/shardfc/${module#src/}
if [[ ! -e $module ]]; then
    echo "mutation.sh: no module $1 under src/shardfc" >&2
    exit 2
fi

tests=("$@")
if [[ ${#tests[@]} -eq 0 ]]; then
    rel=${module#src/shardfc/}
    if [[ -f $module ]]; then
        dir=$(dirname "$rel")
        [[ $dir == . ]] && dir= || dir=$dir/
        name=$(basename "$rel" .py)
        candidate=tests/${dir}test_${name#_}.py
        if [[ -f $candidate ]]; then tests=("$candidate"); else tests=("tests/${dir%/}"); fi
    else
        tests=("tests/$rel")
    fi
    if [[ ! -e ${tests[0]} ]]; then
        echo "mutation.sh: no tests found for $module (looked for ${tests[0]}); name them after MODULE" >&2
        exit 2
    fi
fi

python=${PYTHON:-python}
mutmut=${MUTMUT:-$(dirname "$(command -v "$python")")/mutmut}
[[ -x $mutmut ]] || mutmut=$(command -v mutmut) || { echo "mutation.sh: mutmut not installed: pip install -e '.[mutation]'" >&2; exit 2; }
jobs=${JOBS:-$(nproc)}

work=.mutation/$(echo "${module#src/shardfc/}" | tr '/' '.')
[[ ${FRESH:-0} == 1 ]] && rm -rf "$work"
mkdir -p "$work"
# This checkout's files (tracked and new, not ignored) replace the copy's; mutmut's results stay.
find "$work" -mindepth 1 -maxdepth 1 ! -name mutants -exec rm -rf {} +
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work"

# The repository's pyproject.toml with its [tool.mutmut] settings kept but its scope (what is mutated,
# which tests run) replaced by this module's.
"$python" - "$work/pyproject.toml" "$module" "${tests[@]}" <<'EOF'
import json
import re
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mutmut itself reads its config with toml there
    import toml as tomllib

path, module, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
text = open(path).read()
settings = tomllib.loads(text).get("tool", {}).get("mutmut", {})
for old in ("paths_to_mutate", "tests_dir"):  # mutmut 2's names of the scope
    settings.pop(old, None)
settings["source_paths"] = [module]
# The rest of the package (tests import it from mutants/src), and docs/ (tests that compare a page with
# the code read it from there).
settings["also_copy"] = sorted(set(settings.get("also_copy", [])) | {"src/shardfc", "docs"})
settings["pytest_add_cli_args_test_selection"] = tests
# In mutmut's own process: it records which tests reach which function, which test processes of
# pytest-xdist (the repository's addopts) would hide from it.
settings["pytest_add_cli_args"] = ["-p", "no:xdist", "-o", "addopts=-ra"]
text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text).rstrip() + "\n\n[tool.mutmut]\n"
text += "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())
open(path, "w").write(text)
EOF
echo "mutation.sh: mutating $module against ${tests[*]} in $work ($jobs jobs)"
cd "$work"
# One thread per test process: mutmut runs $jobs of them, and forked torch with an OpenMP pool can hang.
# The processes the tests start (spawned ranks, `shardfc` subprocesses) run the mutant too:
# - they inherit MUTANT_UNDER_TEST, and import the mutated copy (scripts/mutation_ranks/sitecustomize.py
#   puts SHARDFC_MUTMUT_SRC first on their path; the caller's PYTHONPATH, which could hold a checkout's
#   src/, is replaced);
# - ranks start as fresh interpreters (SHARDFC_START_METHOD=spawn), not from launch.spawn's fork server:
#   mutmut forks each mutant's test process from its own, so a server started by the clean run would be
#   shared by every mutant and fork ranks with the clean run's environment, running the unmutated code;
# - in mutmut's stats run, scripts/mutation_ranks/ (sitecustomize.py in each such process, a pytest
#   plugin in mutmut's) adds what those processes reached to the test that started them: without it a
#   function called only inside ranks counts as reached by no test and its mutants are never run;
# - the plugin also gives each test what the setups of the fixtures it uses reached, and their seconds
#   (mutmut counts both only for the test inside which a shared fixture was set up), and caps the
#   collectives' timeout of the worlds the tests launch (LAUNCH_TIMEOUT_S).
start=$(date +%s)
read -r -a names <<< "${MUTANTS:-}"
hits=$PWD/rank_hits
mkdir -p "$hits"
PYTHONPATH="$root/scripts/mutation_ranks" SHARDFC_MUTMUT_SRC="$PWD/mutants/src" PYTEST_PLUGINS=shardfc_mutmut_ranks \
    SHARDFC_MUTMUT_HITS="$hits" SHARDFC_MUTMUT_LAUNCH_TIMEOUT_S="${LAUNCH_TIMEOUT_S:-30}" \
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 SHARDFC_START_METHOD=spawn "$mutmut" run --max-children "$jobs" "${names[@]}" || status=$?
echo "mutation.sh: $module took $(( $(date +%s) - start )) s"
env -u PYTHONPATH "$mutmut" results
echo "mutation.sh: $module, mutants by state:"
env -u PYTHONPATH "$mutmut" results --all true | sed -n 's/.*: //p' | sort | uniq -c
exit "${status:-0}"
