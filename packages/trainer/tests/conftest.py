import pytest
from trainer_fixtures import make_tiny_setup


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory) -> dict[str, str]:
    return make_tiny_setup(tmp_path_factory.mktemp("tiny"))
