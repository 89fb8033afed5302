"""A proof of the shared secret answers one challenge: it is bound to the role, the run, the rank it claims and the
challenger's nonce. The transports' tests check a wrong secret and another run, not the binding to the rank: with the
rank left out of the signed message every test passed, and a proof made for one rank was accepted for another."""

from openprime.core.auth import answer, check, new_nonce

SECRET = b"0123456789abcdef0123456789abcdef"


def test_a_proof_is_accepted_only_for_what_it_was_made_for():
    nonce = new_nonce()
    proof = answer(SECRET, role="client", run_id="run", rank=1, nonce=nonce)
    assert check(SECRET, proof, role="client", run_id="run", rank=1, nonce=nonce)
    assert not check(SECRET, proof, role="client", run_id="run", rank=2, nonce=nonce)
    assert not check(SECRET, proof, role="server", run_id="run", rank=1, nonce=nonce)
    assert not check(SECRET, proof, role="client", run_id="other", rank=1, nonce=nonce)
    assert not check(SECRET, proof, role="client", run_id="run", rank=1, nonce=new_nonce())
    assert not check(b"another secret of 32 bytes......", proof, role="client", run_id="run", rank=1, nonce=nonce)
    assert not check(SECRET, proof.hex(), role="client", run_id="run", rank=1, nonce=nonce)  # not bytes
