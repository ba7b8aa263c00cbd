"""transformers' own common model tests (ModelTesterMixin, ConfigTester) on LinearAttentionForCausalLM.

The tests ship in the source distribution of each transformers release on PyPI, not in its wheel. The
install-time step `make transformers-tests` (a prerequisite of `make test`) unpacks the `tests/` folder of the
installed release into build/transformers_tests/transformers_tests (git-ignored; renamed so that it cannot
clash with this folder); TRANSFORMERS_TESTS_DIR points elsewhere. Without that folder this module is skipped.
The source distribution leaves out tests/generation, tests/exporters and tests/utils, which the common files
import from: tests/transformers_stubs stands in for the three names they import (see its README), so
transformers' GenerationTesterMixin tests do not run here; this project's generate tests do.

Every skip below is one transformers applies itself to recurrent-state models: the reason names the tester
(Mamba2ModelTest in tests/models/mamba2/test_modeling_mamba2.py) and what it does.
"""

import importlib.util
import os
import sys
import unittest
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from hf_linear_attn import LinearAttentionConfig, LinearAttentionForCausalLM, LinearAttentionModel

TESTS_DIR = Path(os.environ.get("TRANSFORMERS_TESTS_DIR", Path(__file__).parents[1] / "build" / "transformers_tests"))
if not (TESTS_DIR / "transformers_tests" / "test_modeling_common.py").is_file():
    pytest.skip(
        f"transformers' test files are not in {TESTS_DIR}/transformers_tests: run `make transformers-tests` (it "
        f"fetches the tests/ folder of transformers {transformers.__version__} at install time) to run this module.",
        allow_module_level=True,
    )
pytest.importorskip("parameterized", reason="transformers' common tests need `parameterized` (pip install -e '.[dev]')")


def import_package(folder: Path, name: str) -> None:
    """Import the package `folder/name` as `name` (its modules then import each other, relatively, as its
    submodules), without putting `folder` on sys.path."""
    spec = importlib.util.spec_from_file_location(name, folder / name / "__init__.py",
                                                  submodule_search_locations=[str(folder / name)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)


import_package(TESTS_DIR, "transformers_tests")

from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import (  # noqa: E402
    GenerationTesterMixin,
    ModelTesterMixin,
    ids_tensor,
)


@pytest.fixture(autouse=True, scope="module")
def _registered_like_an_in_tree_model():
    """The common tests pick labels and expected outputs by class name from transformers' own model mappings,
    which list in-tree models only: list ours there too while this module runs."""
    names = {"MODEL_MAPPING_NAMES": LinearAttentionModel,
             "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": LinearAttentionForCausalLM}
    model_type = LinearAttentionConfig.model_type
    for mapping, model_class in names.items():
        getattr(modeling_auto, mapping)[model_type] = model_class.__name__
    yield
    for mapping in names:
        getattr(modeling_auto, mapping).pop(model_type)


MAMBA2 = "as transformers' Mamba2ModelTest (tests/models/mamba2/test_modeling_mamba2.py) does for its recurrent state"


class LinearAttentionModelTester:
    """Tiny configs and inputs for the common tests, in the shape CausalLMModelTester gives them."""

    config_class = LinearAttentionConfig
    base_model_class = LinearAttentionModel
    causal_lm_class = LinearAttentionForCausalLM

    def __init__(self, parent, config_overrides: dict, batch_size: int = 3, seq_length: int = 7) -> None:
        self.parent = parent
        self.config_overrides = config_overrides
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.intermediate_size = 37
        self.max_position_embeddings = 64
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2

    def get_config(self) -> LinearAttentionConfig:
        fields = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        return LinearAttentionConfig(**{**fields, **self.config_overrides})

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # CausalLMModelTester's: right-padded rows
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class LinearAttentionCommonTests(ModelTesterMixin, GenerationTesterMixin):
    """The common tests for one config variant (`config_overrides`); subclasses pick the variant."""

    config_overrides: dict = {}
    all_model_classes = (LinearAttentionModel, LinearAttentionForCausalLM)
    has_attentions = False  # no attention weights to return (Mamba2ModelTest sets the same)

    def setUp(self) -> None:
        self.model_tester = LinearAttentionModelTester(self, self.config_overrides)
        self.config_tester = ConfigTester(
            self, config_class=LinearAttentionConfig, hidden_size=32,
            common_properties=["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"],
        )

    def test_config(self) -> None:
        self.config_tester.run_common_tests()

    @unittest.skip(reason=f"A large model would be needed for that; skipped {MAMBA2}")
    def test_multi_gpu_data_parallel_forward(self) -> None:
        pass


class PlainLinearTest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {}


class HybridWindowWithSinksTest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 3, "num_sink_tokens": 1}


class VectorDecayTest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {"feature_map": "t2r", "feature_dim": 8, "decay": "vector", "decay_low_rank_dim": 4}


class SoftmaxLayersWithGQATest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {"softmax_layers": [0], "use_qk_norm": True, "tie_word_embeddings": True}


class GatedDeltaNetWindowTest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {"update_rule": "delta", "feature_map": "identity", "normalize": False, "decay": "scalar",
                        "conv_size": 4, "output_norm": True, "output_gate": True, "window_size": 3,
                        "num_sink_tokens": 1}


class SoftmaxHeadsTest(LinearAttentionCommonTests, unittest.TestCase):
    config_overrides = {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 3, "num_sink_tokens": 1,
                        "softmax_heads": {0: [1]}, "use_qk_norm": True}
