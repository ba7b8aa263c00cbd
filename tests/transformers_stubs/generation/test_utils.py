"""Stand-in for transformers' tests/generation/test_utils.py, which its source distribution leaves out (see
../README.md): the name test_modeling_common imports, with no tests."""


class GenerationTesterMixin:
    pass
