"""Background responses (POST /v1/responses with background: true) and their cancel, with the openai client
on the fake model: created queued, read back as they run and once done; cancel aborts the engine request
(no request, KV block or stream left), is idempotent, and is an error for a finished or foreground response."""
from __future__ import annotations

import openai
import pytest

from tests.faulty_executor import FaultyExecutor
from tests.server.conftest import MODEL, fake_engine, leaks, no_leaks, start_server, wait_for


@pytest.fixture
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url, api_key="unused", max_retries=0, timeout=30)


def _settled(client, response_id: str, statuses=("completed", "incomplete")):
    return wait_for(lambda: (r := client.responses.retrieve(response_id)).status in statuses and r, 30,
                    f"response {response_id} never reached {statuses}")


def test_created_queued_then_read_back_done_and_continued(fake_server, client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=6, background=True)
    assert r.status == "queued" and r.background and r.output == [] and r.usage is None
    done = _settled(client, r.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 6 and done.output_text
    assert done.incomplete_details.reason == "max_output_tokens" and done.background
    again = client.responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=2)
    assert again.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens  # the earlier turn is in
    with pytest.raises(openai.BadRequestError, match="already ended"):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(again.id)
    wait_for(lambda: no_leaks(fake_server), 10, "the server did not go idle")


def test_cancel_while_generating_aborts_the_engine_request(fake_server, client):
    r = client.responses.create(model=MODEL, input="write a lot", max_output_tokens=1500, background=True)
    running = _settled(client, r.id, ("in_progress",))
    wait_for(lambda: client.responses.retrieve(r.id).output_text, 10, "no text so far")
    assert running.output[0].status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id
    assert client.responses.cancel(r.id).status == "cancelled"  # idempotent
    wait_for(lambda: no_leaks(fake_server), 10, f"leaks: {leaks(fake_server)}")
    after = client.responses.retrieve(r.id)
    assert after.status == "cancelled" and after.usage is None
    assert len(after.output_text.split()) < 1500  # stopped long before max_output_tokens
    with pytest.raises(openai.BadRequestError, match="is cancelled"):
        client.responses.create(model=MODEL, input="go on", previous_response_id=r.id)


def test_deleting_a_running_background_response_aborts_it(fake_server, client):
    r = client.responses.create(model=MODEL, input="write a lot", max_output_tokens=1500, background=True)
    _settled(client, r.id, ("in_progress",))
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    wait_for(lambda: no_leaks(fake_server), 10, f"leaks: {leaks(fake_server)}")


def test_background_needs_store_and_is_not_streamed(client):
    with pytest.raises(openai.BadRequestError, match="needs store") as e:
        client.responses.create(model=MODEL, input="hi", background=True, store=False)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError, match="stream") as e:
        client.responses.create(model=MODEL, input="hi", background=True, stream=True)
    assert e.value.body["param"] == "stream"


def test_a_step_fault_fails_the_background_response(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.005, wrap=FaultyExecutor))
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1500, background=True)
        _settled(client, r.id, ("in_progress",))
        server.async_engine.engine.executor.fail(1)
        failed = _settled(client, r.id, ("failed",))
        assert "injected fault" in failed.error.message and failed.usage is None
        with pytest.raises(openai.BadRequestError, match="already ended"):
            client.responses.cancel(r.id)
        wait_for(lambda: no_leaks(server), 10, f"leaks: {leaks(server)}")
    finally:
        server.stop()
