"""Stand-in for transformers' tests/exporters/test_export.py, which its source distribution leaves out (see
../README.md): the name test_modeling_common imports, with no tests."""


class ExportTesterMixin:
    pass
