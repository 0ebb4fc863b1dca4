"""ROLE_TYPE: kvyard's names and RTP-LLM's RoleType numbers."""
from __future__ import annotations

import pytest

from kvyard.roles import Role, parse_role


@pytest.mark.parametrize("value,role", [("0", Role.PDFUSION), ("1", Role.PREFILL), ("2", Role.DECODE),
                                        ("3", Role.VIT), ("vit", Role.VIT),
                                        ("4", Role.FRONTEND), (" prefill ", Role.PREFILL), (None, Role.PDFUSION),
                                        ("", Role.PDFUSION)])
def test_names_and_rtp_llm_numbers(value: str | None, role: Role) -> None:
    assert parse_role(value) is role


def test_rtp_llm_numbers_round_trip_for_the_roles_it_has() -> None:
    for role in (Role.PDFUSION, Role.PREFILL, Role.DECODE, Role.VIT, Role.FRONTEND):
        assert parse_role(str(role.rtp_type)) is role


@pytest.mark.parametrize("value,needle", [("9", "RTP-LLM's numbers"), ("NOPE", "one of")])
def test_others_are_refused_by_name(value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_role(value)
