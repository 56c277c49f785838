"""A multi-turn image chat for the vision engines' tests: three image turns plus a turn whose
history edits the previous reply, a side chat between turns (so every hit is restored from
blocks, not the live state), and the checks a cached run must pass against --no-cache."""

import numpy as np

from promptcache.core.images import image_from_pixels
from promptcache.engines.base import SamplingParams

PARAMS = SamplingParams(max_tokens=8)


def picture(seed, size=(64, 80)):
    rng = np.random.RandomState(seed)
    return image_from_pixels(rng.randint(0, 256, (*size, 3), dtype=np.uint8))


def user(*parts):
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}


def conversation():
    """Image turns of one chat, then a turn whose history edits the previous reply."""
    return [
        ([user("what is in ", None, " here?")], [picture(2)]),
        ([user("and in ", None, " now?")], [picture(3, (32, 48))]),
        ([user("compare both with ", None)], [picture(4)]),
        ([user("say it shorter")], []),
    ]


def run_chat(engine, other):
    """The conversation turn by turn (a turn of ``other`` chat between: every hit is restored
    from blocks, not the live state). Returns (replies, cached tokens, prompt ids, spans)."""
    history, images = [], []
    out = []
    for i, (messages, new_images) in enumerate(conversation()):
        history += messages
        images += new_images
        if i == len(conversation()) - 1:  # the edited turn: the previous reply rewritten
            history[-2] = {"role": "assistant", "content": "an edited answer"}
        ids, spans = engine.encode_chat_images(history, None, images)
        events = list(engine.generate(ids, PARAMS, images=spans))
        reply = events[-1].completion_ids
        out.append((reply, events[0].cached_tokens, ids, spans))
        history.append({"role": "assistant", "content": engine.tokenizer.decode(reply)})
        # the side chat's text changes each turn: its image's rows come from the embedding cache
        o_ids, o_spans = engine.encode_chat_images([user(f"other {i} ", None)], None, [picture(9)])
        list(other(o_ids, o_spans))
    return out


def check_conversation(cached, plain):
    """The chat on ``cached`` equals it on ``plain`` (--no-cache), greedy, turn by turn; every
    turn from the second reuses the previous one, images included; each image is encoded once.
    Returns the cached run's (reply, cached tokens, ids, spans) per turn."""

    def side(engine):
        return lambda ids, spans: engine.generate(ids, PARAMS, images=spans)

    got = run_chat(cached, side(cached))
    want = run_chat(plain, side(plain))
    assert [g[0] for g in got] == [w[0] for w in want]  # greedy replies, turn by turn
    assert len({tuple(w[0]) for w in want}) > 1 and all(len(set(w[0])) > 1 for w in want)
    cached_tokens = [g[1] for g in got]
    assert cached_tokens[0] == 0 and all(c > 0 for c in cached_tokens[1:])
    for _, hit, _, spans in got[1:3]:  # the hit reaches past the earlier turns' images
        assert hit >= spans[-2].end
    edited = got[3]
    assert spans_before(edited[3], edited[1]) == 3  # all three images restored, none encoded
    stats = cached.cache_stats()["vision"]
    # four distinct images (three turns + the side chat's), each encoded once; the side chat's
    # image after new text three more times from the vision-embedding cache
    assert stats["encoder_runs"] == 4 and stats["cache_hits"] >= 3
    assert stats["images_fed"] == stats["encoder_runs"] + stats["cache_hits"]
    cached.cache.check_integrity()
    return got


def spans_before(spans, hit):
    return sum(1 for s in spans if s.end <= hit)


def replies_alone_and_together(alone, together, prompts, params):
    """Each prompt's completion ids run one at a time on ``alone``, and all at once (released
    together by a barrier) on ``together``: (want, got)."""
    import threading

    def reply(engine, ids, spans):
        return list(engine.generate(ids, params, images=spans))[-1].completion_ids

    want = [reply(alone, ids, spans) for ids, spans in prompts]
    got: list = [None] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def run(i):
        gate.wait()
        got[i] = reply(together, *prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return want, got
