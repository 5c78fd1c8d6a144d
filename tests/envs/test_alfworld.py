"""Tests of the ALFWorld-style env (``agentrl/ALFWorld-v0``) that need no extra package."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.env import list_envs, make_env
from agentrl.envs.alfworld import SPLITS, ALFWorldEnv, expert_trajectory, generate_scene
from agentrl.envs.alfworld.catalog import CAN_CONTAIN, FAMILIES, OPENABLE
from agentrl.envs.alfworld.pddl_export import entity_id, goal_pddl, scene_to_pddl
from agentrl.envs.alfworld.scene import combination_is_unseen, task_combinations
from agentrl.envs.alfworld.world import listing
from agentrl.errors import EnvError

GOAL_PATTERNS = {
    "pick_and_place_simple": r"put (a|some) \w+ (in|on) \w+\.",
    "look_at_obj_in_light": r"(look at \w+ under the|examine the \w+ with the) (desklamp|floorlamp)\.",
    "pick_clean_then_place_in_recep": r"(put a clean \w+ in|clean some \w+ and put it in) \w+\.",
    "pick_heat_then_place_in_recep": r"(put a hot \w+ in|heat some \w+ and put it in) \w+\.",
    "pick_cool_then_place_in_recep": r"(put a cool \w+ in|cool some \w+ and put it in) \w+\.",
    "pick_two_obj_and_place": r"(put two \w+ in|find two \w+ and put them in) \w+\.",
}


def _combination(scene):
    return scene.room, scene.task.obj_type, scene.task.target


def _play_expert(env: ALFWorldEnv, seed: int, policy: str = "expert_action") -> tuple[bool, int]:
    _, info = env.reset(seed=seed)
    for step in range(1, env.max_steps + 1):
        cmd = getattr(env, policy)()
        assert cmd in info["admissible_actions"], (seed, step, cmd)
        _, _, terminated, truncated, info = env.step(cmd)
        if terminated or truncated:
            return terminated, step
    return False, env.max_steps


def test_registered_id_makes_the_env_with_alfworld_intro():
    env = make_env("agentrl/ALFWorld-v0")
    obs, info = env.reset(seed=3)
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
    assert obs.endswith(f"Your task is to: {info['instruction']}")
    assert info["tools"] == []
    assert info["admissible_actions"] == sorted(info["admissible_actions"])
    assert {"look", "inventory", "help"} <= set(info["admissible_actions"])
    assert all(a.startswith("go to ") for a in info["admissible_actions"][:-3])


def test_same_seed_and_split_give_the_same_scene_and_others_differ():
    assert generate_scene(11, "train") == generate_scene(11, "train")
    assert generate_scene(11, "train") != generate_scene(12, "train")
    assert generate_scene(11, "train") != generate_scene(11, "valid_seen")
    env = ALFWorldEnv()
    first = env.reset(seed=5)
    assert env.reset(seed=5) == first


def test_split_comes_from_constructor_or_reset_options():
    env = ALFWorldEnv(split="valid_unseen")
    env.reset(seed=1)
    assert env.scene.split == "valid_unseen"
    env.reset(seed=1, options={"split": "train"})
    assert env.scene == generate_scene(1, "train")
    with pytest.raises(EnvError, match="unknown split"):
        env.reset(seed=1, options={"split": "test"})
    with pytest.raises(EnvError, match="unknown split"):
        ALFWorldEnv(split="nope")


def test_valid_unseen_combinations_never_occur_in_train_or_valid_seen():
    for fam in FAMILIES:
        seen, unseen = set(task_combinations(fam, False)), set(task_combinations(fam, True))
        assert seen and unseen and not seen & unseen
    for split in SPLITS:
        for seed in range(300):
            scene = generate_scene(seed, split)
            assert combination_is_unseen(*_combination(scene)) == (split == "valid_unseen")


def test_every_family_appears_with_alfworld_goal_text():
    found = set()
    for seed in range(120):
        task = generate_scene(seed).task
        assert re.fullmatch(GOAL_PATTERNS[task.family], task.goal), task.goal
        found.add(task.family)
    assert found == set(FAMILIES)


def test_scenes_are_plausible_and_numbered():
    for seed in range(200):
        scene = generate_scene(seed)
        for kind in set(scene.recep_types):
            names = [
                n for n, t in zip(scene.recep_names, scene.recep_types, strict=True) if t == kind
            ]
            assert sorted(names) == sorted(f"{kind} {i}" for i in range(1, len(names) + 1))
        for kind, r in zip(scene.obj_types, scene.obj_start, strict=True):
            host = scene.recep_types[r]
            assert kind in CAN_CONTAIN[host] or kind.endswith("lamp"), (kind, host)


def test_observations_follow_alfworld_style():
    env = ALFWorldEnv()
    env.reset(seed=0)
    scene = env.scene
    closed = next(i for i, t in enumerate(scene.recep_types) if t in OPENABLE)
    name = scene.recep_names[closed]
    obs, *_ = env.step(f"go to {name}")
    assert obs == f"You arrive at {name}. The {name} is closed."
    obs, *_ = env.step(f"open {name}")
    assert re.fullmatch(rf"You open the {name}\. The {name} is open\. In it, you see .+\.", obs)
    obs, *_ = env.step(f"go to {name}")
    assert obs == "Nothing happens."
    obs, *_ = env.step("inventory")
    assert obs == "You are not carrying anything."
    full = next(
        r
        for r, c in enumerate(env.world.contents)
        if c and r != closed and scene.recep_types[r] not in OPENABLE
    )
    rname = scene.recep_names[full]
    obj = scene.obj_names[env.world.contents[full][0]]
    obs, _, _, _, info = env.step(f"go to {rname}")
    assert obs.startswith(f"You arrive at {rname}. On the {rname}, you see a ")
    if not obj.startswith(("desklamp", "floorlamp")):
        obs, _, _, _, info = env.step(f"take {obj} from {rname}")
        assert obs == f"You pick up the {obj} from the {rname}."
        assert f"examine {obj}" in info["admissible_actions"]
        assert env.step("inventory")[0] == f"You are carrying: a {obj}."


def test_listing_matches_alfworld_list_style():
    assert listing([]) == "nothing"
    assert listing(["apple 1"]) == "a apple 1"
    assert listing(["apple 1", "mug 2"]) == "a apple 1, and a mug 2"
    assert listing(["a 1", "b 1", "c 1"]) == "a a 1, a b 1, and a c 1"


def test_every_admissible_command_does_something_and_junk_does_nothing():
    rng = random.Random(0)
    env = ALFWorldEnv()
    for seed in range(40):
        _, info = env.reset(seed=seed)
        for _ in range(30):
            obs, _, _, _, after = env.step(rng.choice(info["admissible_actions"]))
            assert obs != "Nothing happens."
            info = after
            if after["won"]:
                break
        assert env.step("take the moon from the sky")[0] in (
            "Nothing happens.",
            "The episode is over. Call reset() to start a new one.",
        )


def test_put_aliases_and_sloppy_case_are_understood():
    for style, answer in (
        ("put", "You put the {o} in/on the {r}."),
        ("move", "You move the {o} to the {r}."),
    ):
        for spelling in (
            "put {o} in/on {r}",
            "  PUT {o} on {r}. ",
            "move {o} to {r}",
            "put {o} in {r}",
        ):
            env = ALFWorldEnv(put_style=style)
            env.reset(seed=0)
            while env.world.held < 0:
                env.step(env.expert_action())
            here = env.world.loc
            o, r = env.scene.obj_names[env.world.held], env.scene.recep_names[here]
            obs, *_ = env.step(spelling.format(o=o, r=r))
            assert obs == answer.format(o=o, r=r), (style, spelling, obs)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(("policy", "longest"), [("oracle_action", 20), ("expert_action", 50)])
def test_expert_and_oracle_solve_every_task(split, policy, longest):
    """The oracle walks straight to hidden objects; the expert searches, so it takes longer."""
    env = ALFWorldEnv(split=split)
    n = 1000 if split == "train" else 300
    lengths = []
    for seed in range(n):
        won, steps = _play_expert(env, seed, policy)
        assert won, f"{policy} failed {split}/{seed} ({env.scene.task.goal})"
        lengths.append(steps)
    assert max(lengths) <= longest


def test_expert_recovers_after_random_actions():
    rng = random.Random(1)
    env = ALFWorldEnv()
    for seed in range(200):
        _, info = env.reset(seed=seed)
        done = False
        for _ in range(8):
            _, _, terminated, truncated, info = env.step(rng.choice(info["admissible_actions"]))
            done = terminated or truncated
            if done:
                break
        while not done:
            _, _, terminated, truncated, info = env.step(env.expert_action())
            done = terminated or truncated
        assert info["won"], f"expert did not recover on seed {seed}"


def test_episode_is_truncated_by_the_env_after_50_steps():
    env = ALFWorldEnv()
    env.reset(seed=2)
    for step in range(1, 51):
        obs, reward, terminated, truncated, _ = env.step("look")
        assert reward == 0.0 and not terminated
        assert truncated == (step == 50)
    obs, reward, terminated, truncated, _ = env.step(env.expert_action())
    assert reward == 0.0 and truncated and "reset()" in obs


def test_sparse_reward_is_one_only_on_success():
    env = ALFWorldEnv()
    env.reset(seed=7)
    rewards = []
    while True:
        _, reward, terminated, truncated, _ = env.step(env.expert_action())
        rewards.append(reward)
        if terminated or truncated:
            break
    assert terminated and rewards[-1] == 1.0 and sum(rewards) == 1.0


def test_dense_reward_pays_each_subgoal_once():
    for seed in range(30):
        env = ALFWorldEnv(dense_reward=True, subgoal_reward=0.1)
        env.reset(seed=seed)
        total, terminated = 0.0, False
        while not terminated:
            _, reward, terminated, _, _ = env.step(env.expert_action())
            total += reward
        family = env.scene.task.family
        subgoals = 1 if family == "pick_and_place_simple" else 2
        assert total == pytest.approx(1.0 + 0.1 * subgoals), (seed, family)
    # Putting a task object down and taking it again pays nothing more.
    env = ALFWorldEnv(dense_reward=True)
    env.reset(seed=0)
    reward = 0.0
    while env.world.held < 0:
        _, reward, _, _, info = env.step(env.expert_action())
    assert reward == pytest.approx(0.1)
    put = next(a for a in info["admissible_actions"] if a.startswith("put "))
    take = put.replace("put ", "take ", 1).replace(" in/on ", " from ")
    assert env.step(put)[1] == 0.0
    obs, reward, *_ = env.step(take)
    assert obs.startswith("You pick up") and reward == 0.0


def test_invalid_penalty_charges_each_wasted_step_only():
    env = ALFWorldEnv(invalid_penalty=0.05, max_steps=20)
    _, info = env.reset(seed=3)
    assert info["invalid_action"] is False
    obs, reward, _, _, after = env.step("take unicorn 1 from nowhere 1")
    assert obs == "Nothing happens." and reward == pytest.approx(-0.05) and after["invalid_action"] is True
    snap = env.snapshot()
    valid = info["admissible_actions"][0]
    obs, reward, _, _, after = env.step(valid)
    assert obs != "Nothing happens." and reward == 0.0 and after["invalid_action"] is False
    env.restore(snap)
    assert env._info()["invalid_action"] is True  # the flag is part of the restored state
    # A win is still worth 1.0 on its own step, so it still counts as a success.
    env.reset(seed=3)
    env.step("jump")
    while True:
        _, reward, terminated, truncated, _ = env.step(env.expert_action())
        if terminated or truncated:
            break
    assert terminated and reward == 1.0
    assert ALFWorldEnv().invalid_penalty == 0.0  # off by default
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(EnvError, match="invalid_penalty"):
            ALFWorldEnv(invalid_penalty=bad)


def test_restored_env_continues_identically():
    rng = random.Random(3)
    env = ALFWorldEnv(dense_reward=True)
    for seed in range(20):
        _, info = env.reset(seed=seed)
        for _ in range(rng.randrange(0, 10)):
            _, _, terminated, _, info = env.step(rng.choice(info["admissible_actions"]))
            if terminated:
                break
        snap = env.snapshot()
        actions = [rng.choice(info["admissible_actions"]) for _ in range(15)]
        first = [env.step(a) for a in actions]
        for _ in range(2):  # a snapshot can be restored more than once
            env.restore(snap)
            assert [env.step(a) for a in actions] == first


def test_snapshot_is_independent_of_later_steps():
    env = ALFWorldEnv()
    env.reset(seed=4)
    snap = env.snapshot()
    before = (snap.world.contents[0][:], snap.world.loc, snap.steps)
    for _ in range(6):
        env.step(env.expert_action())
    assert (snap.world.contents[0], snap.world.loc, snap.steps) == before


@settings(deadline=None, max_examples=150)
@given(
    action=st.one_of(
        st.text(max_size=300),
        st.binary(max_size=300),
        st.sampled_from(
            [
                "",
                " ",
                "\x00",
                "go to",
                "take",
                "put  in/on ",
                "open cabinet 999",
                "go to go to cabinet 1",
            ]
        ),
    )
)
def test_fuzzed_actions_always_get_an_observation(action):
    env = ALFWorldEnv()
    env.reset(seed=9)
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, str) and obs
    assert isinstance(info["admissible_actions"], list)


def test_huge_and_binary_actions_get_nothing_happens():
    env = ALFWorldEnv()
    env.reset(seed=9)
    for junk in ("x" * 100_000, "go to " + "cabinet 1 " * 10_000, "\udcff\x00" * 400):
        obs, reward, terminated, truncated, _ = env.step(junk)
        assert obs == "Nothing happens." and reward == 0.0 and not terminated
    # bytes are not text: refused, with the reason (test_all_envs checks every env)
    obs, *_ = env.step(bytes(range(256)) * 400)  # type: ignore[arg-type]
    assert obs == "Nothing happens. The action must be text, got bytes."


def test_pddl_export_names_match_the_alfworld_demangler_order():
    assert entity_id("cabinet 1") == "cabinet_bar_899"
    assert entity_id("cabinet 2") == "cabinet_bar_898"
    assert entity_id("sinkbasin 2") == "sink_bar_898_bar_basin"
    # the demangler numbers ids of a prefix in descending sorted order
    ids = sorted(entity_id(f"mug {i}") for i in range(1, 12))
    assert [ids[-k] for k in range(1, 12)] == [entity_id(f"mug {k}") for k in range(1, 12)]
    for seed in range(30):
        scene = generate_scene(seed)
        problem = scene_to_pddl(scene)
        assert problem.count("(") == problem.count(")")
        for name in scene.recep_names + scene.obj_names:
            assert f" {entity_id(name)} " in problem or f" {entity_id(name)})" in problem
        assert goal_pddl(scene.task) in problem
        assert f"{scene.task.obj_type}Type" in goal_pddl(scene.task)


def test_expert_trajectory_replays_to_a_win():
    pairs = expert_trajectory(4, "valid_seen")
    assert pairs[0][0].startswith("-= Welcome to TextWorld, ALFRED! =-")
    env = ALFWorldEnv(split="valid_seen")
    obs, _ = env.reset(seed=4)
    for i, (seen, action) in enumerate(pairs):
        assert seen == obs
        obs, reward, terminated, _, _ = env.step(action)
        assert terminated == (i == len(pairs) - 1)
    assert reward == 1.0


def test_public_names_are_importable():
    import agentrl.envs.alfworld as pkg

    assert all(getattr(pkg, name, None) is not None for name in pkg.__all__)
    assert "agentrl/ALFWorld-v0" in list_envs()


def test_privileged_plan_is_the_experts_and_wins():
    """Reset info's ``privileged`` text (for a distillation teacher) is a plan that solves the task."""
    from agentrl.envs.alfworld import ALFWorldEnv

    for seed in (0, 7, 42):
        env = ALFWorldEnv()
        _, info = env.reset(seed=seed)
        plan = info["privileged"].removeprefix("The expert's plan: ").split("; ")
        played = 0
        for action in plan:
            _, _, terminated, _, step_info = env.step(action)
            played += 1
            assert "privileged" not in step_info
            if terminated:
                break
        assert terminated and step_info["won"] and played == len(plan)
