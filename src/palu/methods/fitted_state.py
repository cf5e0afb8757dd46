"""What a method with a fitted state shares (KVQuant's codebooks, KIVI's value scales): `state`
is the fitted object or the folder it was saved to, loaded once; its lineage is the calibration
windows it was fitted on; installing it on another model than the one it was fitted on is refused."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar


class FittedState:
    state_class: ClassVar[type]      # the fitted state's class (`load(folder)`, `info`)
    state_what: ClassVar[str]        # how errors name it ("KVQuant state")

    @property
    def loaded(self):
        cached = self.__dict__.get("_loaded_state")
        if cached is None:
            cached = self.state if isinstance(self.state, self.state_class) else self.state_class.load(self.state)
            self.__dict__["_loaded_state"] = cached
        return cached

    def lineage(self) -> tuple[str, ...]:
        cal = self.loaded.info.get("calibration_tag")
        return (cal,) if cal else ()

    def inputs(self) -> dict[str, str]:
        return {} if isinstance(self.state, self.state_class) else {f"{self.name}_state": str(self.state)}

    def check_state_model(self, model) -> None:
        """Refuse a state fitted on another model (its config, its attention weights' hash, its dtype)."""
        from ..calib.stats_file import check_model, dtype_name
        from ..decompose.checkpoint import source_hash
        where = self.state if isinstance(self.state, (str, Path)) else ""
        check_model(self.loaded.info, model.config, source_hash(model), f"the {self.state_what} {where}".rstrip(),
                    dtype=dtype_name(model))
