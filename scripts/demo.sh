#!/usr/bin/env bash
# The CPU demo, from a fresh machine: set up .venv, make 3-digit addition tasks and a tiny
# character-level Llama, warm-start it with SFT to about 40% accuracy, then run RL on TWO nodes
# on this machine (scripts/run.sh --master and --worker 1, rank weights 2,1) and print eval
# accuracy, reward and phase times per iteration, the report and where the logs are.
#
# BATON_DEMO=agent runs the agent demo instead: 3-digit multiplications asked of the
# `calculator` environment (a tool call, the tool's result, then the answer), SFT on worked
# episodes that the environment itself plays, then GRPO on multi-turn episodes (configs/agent-demo.yaml).
#
#   bash scripts/demo.sh            (BATON_DEMO_DIR sets the folder, BATON_DEMO_SEED the seed of
#                                    tasks, model, SFT and RL; default 0; BATON_DEMO arithmetic or agent)
set -euo pipefail
cd "$(dirname "$0")/.."
seed="${BATON_DEMO_SEED:-0}"
if ! [[ "$seed" =~ ^[0-9]+$ ]]; then
  echo "BATON_DEMO_SEED must be a non-negative integer (got '$seed'), e.g. BATON_DEMO_SEED=1" >&2
  exit 2
fi
demo="${BATON_DEMO:-arithmetic}"
case "$demo" in
  arithmetic|agent) ;;
  *) echo "BATON_DEMO must be one of: arithmetic (the default), agent (got '$demo'), e.g. BATON_DEMO=agent" >&2
     exit 2 ;;
esac
source scripts/venv.sh
ensure_project_venv

work="${BATON_DEMO_DIR:-$PWD/demo-run}"
py="$PWD/.venv/bin/python"
# PYTHONUNBUFFERED: progress lines reach the screen as they happen, also through a pipe.
# PYTHONSAFEPATH: the repository first on the import path, never the current folder.
export PYTHONPATH="$PWD" PYTHONSAFEPATH=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
rm -rf "$work"            # the demo's own folder: every demo starts from scratch
mkdir -p "$work"
echo "== demo folder: $work"

if [ "$demo" = agent ]; then
  echo "== 1/4 tasks: 5000 train and 200 eval 3-digit multiplications for the calculator, and 200 worked episodes"
  "$py" -P -m rollout.tasks make --kind calculator --ops '*' --out "$work/data" --train 5000 --eval 200 --digits 3 \
    --seed "$seed"
  "$py" -P -m rollout.envs.worked --env calculator --tasks "$work/data/train.jsonl" --out "$work/worked.jsonl" \
    --count 200
  sft=(--data "$work/worked.jsonl" --eval-env calculator --eval-max-turns 3 --max-new-tokens 24 --eval-every 10
       --target-accuracy 0.30 --lr 2e-3 --batch-size 32 --steps 600)
  goal="episode success rate reaches 30%"
  threads=1   # on a loaded 2-core machine: ~1 s a step (batch 32) with one thread, 12-15 s (batch 64) with two
  config=configs/agent-demo.yaml
else
  echo "== 1/4 tasks: 5000 train and 500 eval 3-digit additions"
  "$py" -P -m rollout.tasks make --kind arithmetic --out "$work/data" --train 5000 --eval 500 --digits 3 --seed "$seed"
  sft=(--data "$work/data/train.jsonl" --target-accuracy 0.40 --lr 1e-3 --eval-every 25 --steps 1500)
  goal="greedy eval accuracy reaches 40%"
  threads=2
  config=configs/demo.yaml
fi

echo "== 2/4 a tiny character-level Llama"
"$py" -P -m train.tiny --out "$work/tiny" --seed "$seed"

echo "== 3/4 SFT warm start until $goal (RL starts past the jump, with headroom)"
OMP_NUM_THREADS=$threads "$py" -P -m train.sft --model "$work/tiny" "${sft[@]}" --out "$work/sft" \
  --eval-data "$work/data/eval.jsonl" --seed "$seed" 2>&1 \
  | tee "$work/sft.log" | grep --line-buffered -E "accuracy|wrote|step +[0-9]*00 " || true
[ -f "$work/sft/config.json" ] || { echo "SFT did not write $work/sft; see $work/sft.log" >&2; exit 1; }

echo "== 4/4 RL on two nodes of this machine (logs: $work/node-0.log, $work/node-1.log)"
mkdir -m 750 "$work/run"
common=(--data-path "$work/data" --log-path "$work/run" --rl-phase both --eval-interval 1
        --num-nodes 2 --rank-weights 2,1 --config "$config" "model.path=$work/sft"
        "run.seed=$seed" "rollout.seed=$seed" "train.seed=$seed")
setsid scripts/run.sh "${common[@]}" --master >"$work/node-0.log" 2>&1 &
master=$!
setsid scripts/run.sh "${common[@]}" --worker 1 >"$work/node-1.log" 2>&1 &
worker=$!
echo "$master $worker" >"$work/nodes.pgid"   # the nodes' process groups (setsid), for whoever must stop them
# One line per finished iteration while the nodes run, from the master's console.
tail -n +1 -F --pid="$master" "$work/node-0.log" 2>/dev/null \
  | grep --line-buffered -E "iteration [0-9]+ done in" | sed -u 's/.*baton\.driver: /   /' &
follower=$!
trap 'kill -TERM -- -$master -$worker 2>/dev/null || true; kill $follower 2>/dev/null || true' INT TERM EXIT
rc=0
wait "$master" || rc=$?
wait "$worker" || rc=$((rc ? rc : $?))
wait "$follower" 2>/dev/null || true
trap - INT TERM EXIT
if [ "$rc" != 0 ]; then
  echo "a node failed (exit $rc); last lines:" >&2
  tail -n 20 "$work/node-0.log" "$work/node-1.log" >&2
  exit "$rc"
fi

"$py" -P -m coordination report --log-path "$work/run" --table
echo
echo "logs:    $work/run/logs/both/rank-{0,1}/  (driver, inference, trainer)  and $work/node-{0,1}.log"
echo "metrics: $work/run/metrics/iter-N.json   checkpoints: $work/run/checkpoints/"
echo "status:  scripts/status.sh --log-path $work/run"
