"""Adds lowp's gitignored conf/local/ to Hydra's search path, for site presets such as
conf/local/hydra/launcher/<site>.yaml (which include the shipped `slurm` preset).

Only for lowp's own app: other Hydra apps in the same environment see no change.
"""

# no `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules (dataclasses)

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class LowpLocalSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from harness.config.paths import CONF_DIR

        local = CONF_DIR / "local"
        ours = any(e.path in (str(CONF_DIR), f"file://{CONF_DIR}") for e in search_path.get_path())
        if ours and local.is_dir():
            search_path.append(provider="lowp-local", path=f"file://{local}")
