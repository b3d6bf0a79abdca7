"""PolicyMap precedence, ambiguity, inheritance, islands, config and explain."""

import json
import stat
import threading

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, PolicyMap, PolicySpecError


def encoder() -> nn.Module:
    layer = lambda: nn.ModuleDict(  # noqa: E731
        {"attn": nn.Linear(4, 4), "attn_norm": nn.LayerNorm(4), "mlp": nn.Linear(4, 4)}
    )
    return nn.ModuleDict({"layers": nn.ModuleList([layer(), layer()]), "head": nn.Linear(4, 2)})


def resolved(model, pmap):
    return {name: r.policy.name for name, r in pmap.resolve(model).items()}


def test_precedence_exact_then_regex_then_type_then_default():
    m = encoder()
    pmap = PolicyMap(
        "bf16-mixed",
        {
            "layers.0.attn": "64-true",  # exact beats the regex below
            r"layers\.\d+\.attn": "32-true",
            nn.Linear: "16-mixed",  # type rule for every other Linear
        },
    )
    got = resolved(m, pmap)
    assert got["layers.0.attn"] == "64-true"
    assert got["layers.1.attn"] == "32-true"
    assert got["layers.0.mlp"] == got["head"] == "16-mixed"
    assert got[""] == got["layers"] == "bf16-mixed"


def test_no_implicit_prefix_match():
    m = encoder()
    got = resolved(m, PolicyMap("bf16-mixed", {r"layers\.0\.attn": "32-true"}))
    assert got["layers.0.attn"] == "32-true"
    assert got["layers.0.attn_norm"] == "32-true"  # island, not the attn rule
    sources = PolicyMap("bf16-mixed", {r"layers\.0\.attn": "32-true"}).resolve(m)
    assert sources["layers.0.attn_norm"].source == "float32 island"


def test_children_inherit_their_parents_policy_unless_ruled():
    m = encoder()
    pmap = PolicyMap("32-true", {r"layers\.1": "bf16-true", r"layers\.1\.mlp": "32-true"})
    got = resolved(m, pmap)
    assert got["layers.1.attn"] == got["layers.1.attn_norm"] == "bf16-true"
    assert got["layers.1.mlp"] == "32-true"
    assert got["layers.0.attn"] == "32-true"


def test_two_rules_of_one_rank_are_an_error_naming_both():
    m = encoder()
    pmap = PolicyMap("bf16-mixed", {r"layers\.0\..*": "32-true", r".*\.attn": "16-mixed"})
    with pytest.raises(PolicySpecError, match=r"layers.0.attn.*2 regex rules.*'layers\\\\.0"):
        pmap.resolve(m)

    class Scaled(nn.Module):
        pass

    class Both(nn.Linear, Scaled):
        pass

    both_types = PolicyMap("bf16-mixed", {nn.Linear: "32-true", Scaled: "16-mixed"})
    with pytest.raises(PolicySpecError, match="type rules of the same rank with different values"):
        both_types.resolve(nn.Sequential(Both(2, 2)))


def test_a_subclass_type_rule_outranks_its_base_and_equal_values_agree():
    """Rules for nn.Linear and a subclass of it could not coexist ("make them disjoint"),
    even giving one policy; the subclass's rule now decides for its instances, as Python's
    dispatch picks the most specific type, and rules that agree are no conflict."""

    class Mine(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(2, 2), Mine(2, 2))
    got = resolved(m, PolicyMap("bf16-mixed", {nn.Linear: "bf16-true", Mine: "32-true"}))
    assert (got["0"], got["1"]) == ("bf16-true", "32-true")
    got = resolved(m, PolicyMap("bf16-mixed", {Mine: "32-true", nn.Module: "16-mixed"}))
    assert (got["0"], got["1"]) == ("16-mixed", "32-true")
    layer = nn.TransformerEncoderLayer(8, 2, 16)  # (out_proj: a subclass of Linear)
    rules = {nn.Linear: "32-true", r".*out_proj": "32-true", r".*": "32-true"}
    same = PolicyMap("bf16-mixed", rules)
    assert resolved(layer, same)["self_attn.out_proj"] == "32-true"


def test_islands_only_under_mixed_policies_and_overridable():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Softmax(-1))
    assert resolved(m, PolicyMap("bf16-mixed"))["1"] == "32-true"
    assert resolved(m, PolicyMap("bf16-mixed"))["2"] == "32-true"
    assert resolved(m, PolicyMap("bf16-true"))["1"] == "bf16-true"
    assert resolved(m, PolicyMap("bf16-mixed", {nn.LayerNorm: "bf16-mixed"}))["1"] == "bf16-mixed"
    assert resolved(m, PolicyMap("bf16-mixed", float32_islands=False))["1"] == "bf16-mixed"


def test_bad_rules():
    with pytest.raises(PolicySpecError, match="not a valid regex"):
        PolicyMap("32-true", {"layers.(": "16-mixed"})
    with pytest.raises(PolicySpecError, match="must be a module path regex"):
        PolicyMap("32-true", {3: "16-mixed"})
    with pytest.raises(PolicySpecError, match="unknown precision 'fp17'"):
        PolicyMap("32-true", {"head": "fp17"})
    # None reads as "no rule" and was the global policy of the moment, silently
    with mixprec.policy_scope("32-true"):
        with pytest.raises(PolicySpecError, match="rule '1' has no policy"):
            PolicyMap("bf16-true", {"1": None})
        with pytest.raises(PolicySpecError, match="rule LayerNorm has no policy"):
            PolicyMap("bf16-true", {nn.LayerNorm: None})


def test_config_round_trip_and_code():
    pmap = PolicyMap("bf16-mixed", {r"layers\.\d+\.attn": "32-true", nn.LayerNorm: "bf16-mixed"})
    again = PolicyMap.from_config(pmap.to_config())
    assert again == pmap
    rebuilt = eval(pmap.to_code(), {"mixprec": mixprec, "torch": torch})
    assert rebuilt == pmap
    assert pmap.needs_loss_scaling is False
    assert PolicyMap("bf16-mixed", {"head": "16-mixed"}).needs_loss_scaling is True
    assert pmap.compute_dtypes() == {torch.bfloat16, torch.float32}


def test_a_policy_file_round_trips_and_every_precision_argument_reads_it(tmp_path):
    pmap = PolicyMap("bf16-mixed", {"head": "32-true", nn.LayerNorm: "32-true"})
    path = pmap.save(tmp_path / "policy.json")
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]  # no temporary left
    assert PolicyMap.load(path) == pmap
    assert mixprec.policy.map.as_map(str(path)) == pmap  # a path string, as a flag gives it
    assert mixprec.Precision(path, allow_slow=True).policy == pmap  # a PathLike
    m = encoder()
    assert mixprec.explain(m, str(path))["head"] == Policy("32-true")
    # a single policy's config is a file too
    (tmp_path / "one.json").write_text(json.dumps(Policy("bf16-true").to_config()))
    assert PolicyMap.load(tmp_path / "one.json") == PolicyMap("bf16-true")


def test_saving_a_policy_file_where_it_cannot_go_names_the_file_asked_for(tmp_path):
    """Saving into a directory, or under a missing folder, raised raw OSErrors
    naming the hidden temporary file (".x.json.1234.tmp"), not the path given."""
    pmap = PolicyMap("bf16-mixed", {"head": "32-true"})
    with pytest.raises(IsADirectoryError, match="it is a directory; give a file path, e.g.") as e:
        pmap.save(tmp_path)
    assert ".tmp" not in str(e.value)
    target = tmp_path / "missing" / "policy.json"
    with pytest.raises(FileNotFoundError) as e:
        pmap.save(target)
    assert f"cannot save the policy file {str(target)!r}" in str(e.value)
    assert f"its folder {str(target.parent)!r} does not exist" in str(e.value)
    assert ".tmp" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_saving_one_policy_file_from_several_threads_and_over_a_file_or_a_link(tmp_path):
    """Every save took the same temporary name in one process, so one thread's rename took
    another's temporary file ("cannot save ... No such file or directory", 7 of 30 saves);
    a save over a file reset its permissions, and one through a symbolic link replaced the
    link, leaving the file it named stale."""
    maps = [PolicyMap("bf16-mixed", {"head": p}) for p in ("32-true", "bf16-true", "16-mixed")]
    target = tmp_path / "policy.json"
    failed: list[BaseException] = []

    def save(pmap: PolicyMap) -> None:
        for _ in range(10):
            try:
                pmap.save(target)
            except BaseException as error:  # noqa: BLE001 (any failure fails the test)
                failed.append(error)

    threads = [threading.Thread(target=save, args=(m,)) for m in maps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and PolicyMap.load(target) in maps
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]  # no temporary file left
    target.chmod(0o600)
    maps[0].save(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    link = tmp_path / "current.json"
    link.symlink_to(target)
    maps[1].save(link)
    assert link.is_symlink() and PolicyMap.load(target) == maps[1]


def test_a_type_rule_of_a_local_class_is_refused_at_save_not_at_load(tmp_path):
    """save() wrote a type rule for a class defined in a function, which only load() then
    refused; now save refuses it and writes nothing."""

    class Local(nn.Linear):
        pass

    pmap = PolicyMap("bf16-mixed", {Local: "32-true"})
    with pytest.raises(PolicySpecError, match="type rule Local is a class defined inside a f.*"
                       "PolicyMap.load could not import it back"):  # fmt: skip
        pmap.save(tmp_path / "policy.json")
    assert list(tmp_path.iterdir()) == []


def test_a_type_rule_of_a_nested_class_loads_back(tmp_path, monkeypatch):
    """save() wrote 'nestedmod.Outer.Inner', which load() read as a module 'nestedmod.Outer'
    and refused; it imports the longest module prefix, then the attributes."""
    (tmp_path / "nestedmod.py").write_text(
        "from torch import nn\nclass Outer:\n    class Inner(nn.Linear):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from nestedmod import Outer  # type: ignore[import-not-found]

    pmap = PolicyMap("bf16-mixed", {Outer.Inner: "32-true"}, activations={Outer.Inner: "bf16"})
    assert PolicyMap.load(pmap.save(tmp_path / "policy.json")) == pmap
    with pytest.raises(PolicySpecError, match="cannot import module type 'nestedmod.Outer.Nope'"):
        mixprec.policy.files.import_type("nestedmod.Outer.Nope")


def test_a_dict_of_type_rules_given_as_a_policy_points_to_a_policy_map():
    """Two type keys (or a path and a type) failed sorting them: TypeError '<' not supported."""
    two_types = {nn.Linear: "32-true", nn.LayerNorm: "bf16-mixed"}
    for rules in (two_types, {"head": "32-true", nn.LayerNorm: "16-mixed"}):
        with pytest.raises(PolicySpecError, match="unknown policy config keys .*LayerNorm.*"
                           "go in a PolicyMap"):  # fmt: skip
            mixprec.apply(nn.Linear(2, 2), rules)


def test_a_policy_file_where_one_policy_is_taken_or_without_json_says_so(tmp_path, monkeypatch):
    """'unknown precision' said nothing of files: for a .json path where one policy is taken
    (Policy, policy_scope), or for an existing policy file whose name lacks '.json'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicySpecError, match="'p.json' names a policy file .*PolicyMap.load"):
        Policy("p.json")
    with pytest.raises(PolicySpecError, match="names a policy file"):
        mixprec.set_global_policy("p.json")
    PolicyMap("bf16-mixed").save(tmp_path / "mine.json")
    (tmp_path / "mine.json").rename(tmp_path / "mine")
    with pytest.raises(PolicySpecError, match=r"'mine', which is a file: .* ends in '.json'"):
        mixprec.Precision("mine")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read the policy file .*missing.json.*No such file"),
        ("{not json", "cannot read the policy file .*bad.json.*Expecting property name"),
        ('{"default": "bf17"}', "policy file .*bad.json.*unknown precision 'bf17'; accepted"),
        ('{"default": "bf16-mixed", "rules": [{"path": "x"}]}', "bad.json.*rule 0"),
    ],
)
def test_a_bad_policy_file_says_which_file_and_what_is_wrong(tmp_path, text, message):
    path = tmp_path / ("missing.json" if text is None else "bad.json")
    if text is not None:
        path.write_text(text)
    with pytest.raises(PolicySpecError, match=message):
        mixprec.Precision(str(path))


# Policy files that loaded quietly as something else: each is an error naming the file, the
# key and what it takes (PolicyMap.load, so every precision argument taking a path)
MALFORMED_FILES = {
    "null": ("null", "holds null; a policy file holds a JSON object"),
    "a bare name": ('"bf16-mixed"', "holds the string 'bf16-mixed'.*JSON object"),
    "a list": ("[]", "holds a list"),
    "a misspelled key": (
        '{"default": "bf16-mixed", "rule": [{"path": "head", "policy": "32-true"}]}',
        "unknown policy map key.*'rule'.*the keys are 'default'.*'rules'",
    ),
    "islands as a string": (
        '{"default": "bf16-mixed", "float32_islands": "false"}',
        "'float32_islands' is the string 'false'; it is true or false",
    ),
    "islands null": (
        '{"default": "bf16-mixed", "float32_islands": null}',
        "'float32_islands' is null",
    ),
    "default null": ('{"default": null}', "'default' is null; give a policy"),
    "rules null": ('{"default": "bf16-mixed", "rules": null}', "'rules' is null; it is a list"),
    "rules as an object": (
        '{"default": "bf16-mixed", "rules": {"head": "32-true"}}',
        "'rules' is an object.*it is a list of rules",
    ),
    "a rule's path a number": (
        '{"default": "bf16-mixed", "rules": [{"path": 3, "policy": "32-true"}]}',
        "rule 0 'path' is the number 3; it takes a regex",
    ),
    "a rule's policy null": (
        '{"default": "bf16-mixed", "rules": [{"path": "head", "policy": null}]}',
        "rule 0 'policy' is null; give a policy",
    ),
    "a rule's policy a bool": (
        '{"default": "bf16-mixed", "rules": [{"path": "head", "policy": true}]}',
        "rule 0 'policy': a policy spec must be a string.*not bool",
    ),
    "an unknown key in a rule": (
        '{"default": "bf16-mixed", "rules": [{"path": "head", "policy": "32-true", "x": 1}]}',
        "rule 0 .*unknown key.*'x'.*each rule is",
    ),
    "a rule's type not a module": (
        '{"default": "bf16-mixed", "rules": [{"type": "torch.nn.functional.relu", '
        '"policy": "32-true"}]}',
        "rule 0 'type' 'torch.nn.functional.relu' names function.*not an nn.Module subclass",
    ),
    "a rule given twice": (
        '{"default": "bf16-mixed", "rules": [{"path": "head", "policy": "32-true"}, '
        '{"path": "head", "policy": "bf16-true"}]}',
        "rule 1 repeats the rule for 'head'",
    ),
    "a key given twice": (
        '{"default": "32-true", "default": "bf16-mixed"}',
        "key 'default' appears twice",
    ),
    "a dtype null": (
        '{"default": {"param_dtype": "float32", "compute_dtype": null}}',
        "'default': policy config key 'compute_dtype' is null; it takes a dtype name",
    ),
    "a dtype a number": (
        '{"param_dtype": "float32", "compute_dtype": 16}',
        "policy config key 'compute_dtype' is int 16; it takes a dtype name",
    ),
    "a quantized option null": (
        '{"default": {"quantization_mode": "int4", "source": "float32", "group_size": null}}',
        "quantized policy config key 'group_size' is null",
    ),
    "a quantized source null": (
        '{"default": {"quantization_mode": "int8", "source": null}}',
        "quantized policy config key 'source' is null; it takes a float policy",
    ),
    "a float8 recipe a bool": (
        '{"default": {"quantization_mode": "float8", "source": "float32", "recipe": false}}',
        "quantized policy config key 'recipe' is bool False; it takes a recipe name",
    ),
    "rules without a default": (
        '{"rules": [{"path": "head", "policy": "32-true"}]}',
        "'default', the policy of the modules no rule names, is required",
    ),
}


@pytest.mark.parametrize("case", MALFORMED_FILES)
def test_a_malformed_policy_file_is_an_error_naming_the_file_and_the_key(tmp_path, case):
    text, message = MALFORMED_FILES[case]
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(PolicySpecError, match=f"policy file .*policy.json.*{message}"):
        PolicyMap.load(path)
    with pytest.raises(PolicySpecError, match=message):
        mixprec.Precision(str(path))


def test_a_hand_written_policy_file_with_names_and_configs_loads(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(
        '{"default": "bf16-mixed", "rules": [{"path": "head", "policy": "32-true"}, '
        '{"type": "torch.nn.LayerNorm", "policy": {"param_dtype": "float32"}}], '
        '"float32_islands": false}'
    )
    expected = PolicyMap(
        "bf16-mixed", {"head": "32-true", nn.LayerNorm: "32-true"}, float32_islands=False
    )
    assert PolicyMap.load(path) == expected


def test_float32_islands_must_be_a_bool_in_code_too():
    with pytest.raises(TypeError, match="float32_islands must be True or False, not str 'false'"):
        PolicyMap("bf16-mixed", float32_islands="false")  # type: ignore[arg-type]


def test_default_is_the_global_policy_when_not_given():
    with mixprec.policy_scope("bf16-true"):
        assert PolicyMap().default == Policy("bf16-true")


def test_explain_returns_every_module_and_prints_a_table():
    m = encoder()
    e = mixprec.explain(m, PolicyMap("bf16-mixed", {"head": "32-true"}))
    assert set(e) == {name for name, _ in m.named_modules()}
    assert e["head"] == Policy("32-true")
    assert e.sources["head"] == "path rule 'head'"
    assert e.sources["layers.0.mlp"] == "inherited from layers.0"
    text = str(e)
    assert "effective precision per module" in text and "float32 island" in text


def test_rules_must_be_a_mapping():
    with pytest.raises(TypeError, match="rules must be a mapping.*got str 'bf16-mixed'"):
        PolicyMap("32-true", "bf16-mixed")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got list .*dict\(\.\.\.\)"):
        PolicyMap("32-true", [("head", "bf16-mixed")])  # type: ignore[arg-type]


def test_from_config_rule_without_a_policy_says_what_a_rule_is():
    config = PolicyMap("bf16-mixed", {"head": "32-true"}).to_config()
    del config["rules"][0]["policy"]
    with pytest.raises(PolicySpecError, match=r"rule 0 of the policy map config.*'policy'"):
        PolicyMap.from_config(config)
    with pytest.raises(PolicySpecError, match="PolicyMap.from_config takes the dict"):
        PolicyMap.from_config(Policy("bf16-mixed").to_config())


def test_to_code_refuses_a_class_defined_in_a_function():
    class Local(nn.Linear):
        pass

    with pytest.raises(PolicySpecError, match=r"Local is a class defined inside a function"):
        PolicyMap("bf16-mixed", {Local: "32-true"}).to_code()


def test_a_class_of_the_running_script_is_not_saved_and_is_coded_by_its_bare_name(tmp_path):
    """A type rule on a class of the script being run saved as '__main__.Block', which no
    other process can import back, and to_code() wrote '__main__.Block', a NameError pasted
    into that script."""
    block = type("Block", (nn.Linear,), {"__module__": "__main__"})
    pmap = PolicyMap("bf16-mixed", {block: "32-true"}, activations={block: "checkpoint"})
    with pytest.raises(PolicySpecError, match=r"class of the script being run.*another process"):
        pmap.save(tmp_path / "policy.json")
    assert not (tmp_path / "policy.json").exists()
    code = pmap.to_code()
    assert "    Block: '32-true'," in code and "activations={Block: 'checkpoint'}" in code
    assert "__main__" not in code


def test_as_map_is_the_one_coercion():
    from mixprec.policy.map import as_map

    pmap = PolicyMap("bf16-mixed", {"head": "32-true"})
    assert as_map(pmap) is pmap
    assert as_map(pmap.to_config()) == pmap
    assert as_map("bf16-mixed") == as_map(Policy("bf16-mixed")) == PolicyMap("bf16-mixed")
    assert as_map(Policy("16-true").to_config()) == PolicyMap("16-true")
    assert as_map("bf16-mixed").rules == {}


def test_explain_says_each_autocast_difference_once_for_the_modules_it_holds_for():
    """Every LayerNorm is a float32 island for the same reason: the caption names the
    reason once, after the paths, instead of once per LayerNorm."""
    from rich.console import Console

    model = nn.Sequential(
        nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)
    )
    explanation = mixprec.explain(model, mixprec.PolicyMap("bf16-mixed"))
    assert set(explanation.autocast_differences) == {"1", "3"}
    console = Console(width=400, record=True)
    console.print(explanation)
    text = " ".join(console.export_text().split())
    assert text.count("computes in float32 whatever its input") == 1
    assert "beyond cpu torch.autocast: 1, 3: LayerNorm computes in float32" in text


def test_explain_refuses_a_shared_weight_given_two_dtypes_as_apply_does():
    """explain showed the head of a tied embedding in 32-true under a bf16-true default;
    apply refuses that map (one tensor, two dtypes), and explain now says the same."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 16)
            self.head = nn.Linear(16, 10, bias=False)
            self.head.weight = self.emb.weight

    pmap = PolicyMap("bf16-true", {"head": "32-true"})
    for call in (mixprec.explain, mixprec.apply):
        with pytest.raises(PolicySpecError, match=r"head.weight is shared with 'emb.weight'"):
            call(Tied(), pmap)
    mixprec.explain(Tied(), PolicyMap("32-true", {"head": "bf16-mixed"}))  # (float32 both)
