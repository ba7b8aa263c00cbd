"""Stand-in for transformers' tests/utils/test_configuration_utils.py, which its source distribution leaves out
(see ../README.md): `config_common_kwargs`, arguments every `PretrainedConfig` takes, each with a value other
than its default, which `ConfigTester.create_and_test_config_common_properties` checks a config keeps."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
}
