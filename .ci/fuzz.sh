#!/usr/bin/env bash
# Coverage-guided fuzzing of where the core parses bytes (issue 35 item 6): builds the
# libFuzzer targets of cpp/fuzz/ with clang, ASan and UBSan (cmake -DDATADIST_FUZZ=ON) and runs
# each for a bounded time, seeded from the protocol's golden frames (fuzz/seed_corpus.py reads
# tests/vectors/frames.txt) and the corpus kept in the tree (fuzz/corpus/<target>/). Any crash,
# sanitizer report, leak, hang past the per-input timeout, or a finding of the target's own
# (cpp/fuzz/*.cc say which) fails the run; the input that did it is left in
# $FUZZ_OUT/<target>/ (default build/fuzz-out) and its path printed: make it a vector or a
# regression test, fix it, and add it to fuzz/corpus/<target>/.
#
#   .ci/fuzz.sh                      # 60 s per target
#   FUZZ_SECONDS=600 .ci/fuzz.sh     # longer
#   FUZZ_TARGETS=wire .ci/fuzz.sh    # one target
#   FUZZ_MERGE=1 .ci/fuzz.sh         # afterwards, minimise what was found into fuzz/corpus/
#
# Needs clang and its compiler runtime (Debian: clang, libclang-rt-<version>-dev): installed
# with apt-get when missing and run as root, as in CI. Exit status: 0 clean, 1 a finding,
# 2 the targets could not be built.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-"wire owner"}
build=${FUZZ_BUILD:-build/fuzz}
out=${FUZZ_OUT:-build/fuzz-out}
py=$(command -v python3 || command -v python)

# clang's libFuzzer runtime: does a trivial target link?
links() {
  local dir
  dir=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char *, unsigned long) { return 0; }' >"$dir/t.cc"
  clang++ -fsanitize=fuzzer,address,undefined "$dir/t.cc" -o "$dir/t" >/dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  return $rc
}
if ! command -v clang++ >/dev/null || ! links; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang cmake ninja-build libssl-dev >/dev/null || true
    ver=$(clang++ --version 2>/dev/null | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)
    [ -n "$ver" ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "libclang-rt-$ver-dev" >/dev/null || true
  fi
  if ! command -v clang++ >/dev/null || ! links; then
    echo "fuzz: clang with libFuzzer (libclang-rt-<version>-dev) is not available: cannot build the targets" >&2
    exit 2
  fi
fi

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
CC=clang CXX=clang++ cmake -S cpp -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDATADIST_FUZZ=ON \
  -DDATADIST_BUILD_TESTS=OFF -DDATADIST_BUILD_EXAMPLES=OFF >/dev/null || exit 2
names=()
for t in $targets; do names+=("dd_fuzz_$t"); done
cmake --build "$build" -j "$(nproc)" --target "${names[@]}" >/dev/null || exit 2

failed=0
for t in $targets; do
  work=$(mktemp -d)
  mkdir -p "$work/corpus" "$out/$t"
  [ -d "fuzz/corpus/$t" ] && cp -r "fuzz/corpus/$t/." "$work/corpus/"
  "$py" fuzz/seed_corpus.py "$t" "$work/seeds" >/dev/null
  # UBSan reports are findings too; ASan's leak check runs at the end of each input's process.
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  echo "fuzz: $t for ${seconds}s"
  set +e
  "$build/dd_fuzz_$t" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -max_len=8192 \
    -print_final_stats=1 -artifact_prefix="$out/$t/" "$work/corpus" "$work/seeds" >"$out/$t.log" 2>&1
  rc=$?
  set -e
  tail -n 15 "$out/$t.log"
  if [ $rc -ne 0 ]; then
    echo "fuzz: $t FAILED (exit $rc): see $out/$t.log; the input: $(ls "$out/$t"/ 2>/dev/null | head -3 | tr '\n' ' ')" >&2
    failed=1
  elif [ "${FUZZ_MERGE:-0}" = 1 ]; then
    # minimise the kept corpus: what it held, what was found, and the seeds, into fewest inputs
    mkdir -p "$work/merged" "fuzz/corpus/$t"
    if ! "$build/dd_fuzz_$t" -merge=1 -max_len=8192 -timeout=30 "$work/merged" "fuzz/corpus/$t" "$work/corpus" \
      "$work/seeds" >>"$out/$t.log" 2>&1; then
      echo "fuzz: merging $t's corpus failed: see $out/$t.log" >&2
      failed=1
      rm -rf "$work"
      continue
    fi
    rm -rf "fuzz/corpus/$t"
    mkdir -p "fuzz/corpus/$t"
    cp "$work/merged"/* "fuzz/corpus/$t/"
    echo "fuzz: fuzz/corpus/$t now holds $(ls "fuzz/corpus/$t" | wc -l) inputs ($(du -sb "fuzz/corpus/$t" | cut -f1) bytes)"
  fi
  rm -rf "$work"
done
exit $failed
