"""The observation-consistent experts act on what the agent saw, never on hidden state.

Two checks each, for ALFWorld-v0 and WebShop-v0:

- the env's ``expert_action()`` equals ``expert_from_history`` of the text the
  agent saw (the function is given nothing else), at every step, also after
  random actions;
- two scenes (goals) that look the same to the agent up to a step, but whose
  hidden states differ, get the same actions up to that step. The privileged
  oracle fails this on some pair, so the check can fail.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from agentrl.envs.alfworld import ALFWorldEnv, expert_from_history, generate_scene, parse_goal
from agentrl.envs.alfworld.catalog import FAMILIES
from agentrl.envs.alfworld.expert import can_hold, kind
from agentrl.envs.webshop import WebShopEnv, satisfies
from agentrl.envs.webshop import expert_from_history as shop_expert_from_history

# -- ALFWorld ---------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "valid_unseen"])
def test_alfworld_expert_is_a_function_of_the_text_seen(split):
    rng = random.Random(0)
    env = ALFWorldEnv(split=split)
    checked = 0
    for seed in range(60):
        obs, info = env.reset(seed=seed)
        observations, commands = [obs], []
        for step in range(40):
            if step < rng.randrange(4):  # a random prefix: the expert must read any history
                action = rng.choice(info["admissible_actions"])
            else:
                action = env.expert_action()
                assert action == expert_from_history(observations, commands), (seed, step)
                checked += 1
            obs, _, terminated, truncated, info = env.step(action)
            observations.append(obs)
            commands.append(action)
            if terminated or truncated:
                break
        assert info["won"], f"the expert did not win {split}/{seed} after a random prefix"
    assert checked > 300


def _moved(scene, obj_type: str, avoid: set[int]):
    """``scene`` with every ``obj_type`` object moved to one receptacle outside ``avoid``
    that can hold it (not the target type): a different hidden state."""
    task = scene.task
    spots = [r for r, t in enumerate(scene.recep_types)
             if r not in avoid and can_hold(t, obj_type) and t != task.target]
    if not spots:
        return None
    to = spots[-1]
    start = tuple(to if t == obj_type else r for t, r in zip(scene.obj_types, scene.obj_start, strict=True))
    return None if start == scene.obj_start else dataclasses.replace(scene, obj_start=start)


def _lockstep(scene_a, scene_b, policy: str):
    """Play ``policy`` on both scenes while what the agent saw agrees; the steps it agreed
    on and whether the actions differed at one of them."""
    a, b = ALFWorldEnv(), ALFWorldEnv()
    obs_a, _ = a.reset(options={"scene": scene_a})
    obs_b, _ = b.reset(options={"scene": scene_b})
    agreed = 0
    while obs_a == obs_b:
        act_a, act_b = getattr(a, policy)(), getattr(b, policy)()
        if act_a != act_b:
            return agreed, True
        agreed += 1
        obs_a, _, ta, tra, _ = a.step(act_a)
        obs_b, _, tb, trb, _ = b.step(act_b)
        if ta or tra or tb or trb:
            break
    return agreed, False


def test_alfworld_expert_acts_the_same_on_scenes_that_look_the_same():
    """Scene B hides the task objects elsewhere: until the agent sees a difference,
    the expert must act the same. The oracle, which reads the hidden state, does not."""
    pairs = oracle_differed = 0
    for seed in range(120):
        scene = generate_scene(seed, "valid_seen")
        start = set(scene.obj_start[i] for i, t in enumerate(scene.obj_types) if t == scene.task.obj_type)
        other = _moved(scene, scene.task.obj_type, start)
        if other is None:
            continue
        assert other != scene
        pairs += 1
        agreed, differed = _lockstep(scene, other, "expert_action")
        assert not differed, f"seed {seed}: the expert acted differently on the same history"
        assert agreed >= 1
        oracle_differed += _lockstep(scene, other, "oracle_action")[1]
    assert pairs >= 80
    assert oracle_differed >= pairs // 2, "the oracle should give itself away on hidden objects"


def test_alfworld_expert_wins_every_family_on_every_split():
    for split in ("train", "valid_seen", "valid_unseen"):
        env = ALFWorldEnv(split=split)
        wins: dict[str, list[int]] = {f: [] for f in FAMILIES}
        for seed in range(200):
            _, info = env.reset(seed=seed)
            done = False
            while not done:
                _, _, terminated, truncated, info = env.step(env.expert_action())
                done = terminated or truncated
            wins[info["task_type"]].append(int(info["won"]))
        for family, w in wins.items():
            assert w and sum(w) == len(w), f"{split}/{family}: {sum(w)}/{len(w)}"


def test_goal_sentences_parse_back_to_their_task():
    for seed in range(300):
        task = generate_scene(seed, "train").task
        goal = parse_goal(task.goal)
        assert goal is not None and (goal.family, goal.obj_type, goal.target) == (
            task.family, task.obj_type, task.target)
    assert parse_goal("make me a sandwich.") is None


def test_alfworld_expert_searches_without_knowing_where_the_object_is():
    """It opens and looks where such objects live before taking one it has seen."""
    env = ALFWorldEnv(families=["pick_and_place_simple"], max_receptacles=6)
    obs, _ = env.reset(seed=3)
    action = env.expert_action()
    assert action.startswith("go to ")
    receptacle = action.removeprefix("go to ")
    assert can_hold(kind(receptacle), env.scene.task.obj_type)


def test_easy_levels_keep_the_task_and_cap_the_room():
    for seed in range(100):
        scene = generate_scene(seed, "train", families=("pick_two_obj_and_place",), max_receptacles=4)
        assert scene.task.family == "pick_two_obj_and_place"
        assert 2 <= len(scene.recep_names) <= 4
        assert scene.task.target in scene.recep_types
    assert generate_scene(5, "train") == generate_scene(5, "train", None, None)


# -- WebShop ---------------------------------------------------------------------------


def test_webshop_expert_is_a_function_of_the_pages_seen():
    rng = random.Random(1)
    env = WebShopEnv(num_products=2000)
    checked = 0
    for seed in range(80):
        obs, info = env.reset(seed=seed)
        observations, actions = [obs], []
        done = False
        while not done:
            if info["admissible_actions"] and rng.random() < 0.2:
                action = rng.choice(info["admissible_actions"])
            else:
                action = env.expert_action()
                assert action == shop_expert_from_history(observations, actions), (seed, len(actions))
                checked += 1
            obs, _, terminated, truncated, info = env.step(action)
            observations.append(obs)
            actions.append(action)
            done = terminated or truncated
    assert checked > 300


def test_webshop_expert_ignores_which_product_the_goal_was_drawn_from():
    """Two goals with the same instruction but different target products look the same
    until the receipt: the expert acts the same; the oracle's plan may differ."""
    env = WebShopEnv(num_products=2000)
    pairs = 0
    for seed in range(60):
        env.reset(seed=seed)
        goal = env.goal
        twin = next((p for p in env.catalog.products if p.asin != goal.asin and satisfies(goal, p)), None)
        if twin is None:
            continue
        other = dataclasses.replace(goal, asin=twin.asin, title=twin.title)
        runs = []
        for g in (goal, other):
            obs, _ = env.reset(seed=seed, options={"goal": g})
            trace, done = [obs], False
            while not done:
                action = env.expert_action()
                obs, _, terminated, truncated, _ = env.step(action)
                trace += [action, obs.split("Thank you")[0]]
                done = terminated or truncated
            runs.append(trace)
        assert runs[0] == runs[1], f"seed {seed}: the expert saw the same pages but acted differently"
        pairs += 1
    assert pairs >= 30


def test_webshop_expert_scores_well_but_not_perfectly():
    env = WebShopEnv()
    scores = []
    for seed in range(200):
        env.reset(seed=seed)
        done, reward = False, 0.0
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.expert_action())
            done = terminated or truncated
        scores.append(reward)
    success = sum(s >= 1.0 for s in scores) / len(scores)
    assert 0.8 <= success < 1.0
    assert sum(scores) / len(scores) >= 0.85
