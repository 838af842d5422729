import torch

from primerl_orchestrator.samples import EpisodeTokens, Turn

LAYERS, TOP_K = 2, 2


def rows(start: int, count: int) -> torch.Tensor:
    """Distinct routed-expert rows: row i holds the value start + i everywhere."""
    values = torch.arange(start, start + count, dtype=torch.uint8)
    return values[:, None, None].expand(count, LAYERS, TOP_K).clone()


def turn(prompt, completion, *, versions, logprobs=None, temperature=1.0, routed=None):
    return Turn(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=logprobs or [-0.5 - i for i in range(len(completion))],
        policy_versions=versions,
        temperature=temperature,
        routed_experts=routed,
    )


def test_single_turn():
    episode = EpisodeTokens()
    assert not episode.add_turn(turn([1, 2, 3], [4, 5], versions=[7, 8], logprobs=[-1.0, -2.0], temperature=0.7))
    [sample] = episode.samples
    assert sample.token_ids == [1, 2, 3, 4, 5]
    assert sample.loss_mask == [False, False, False, True, True]
    assert sample.logprobs == [0.0, 0.0, 0.0, -1.0, -2.0]
    # Prompt tokens carry the version that read them: the one that sampled the first token.
    assert sample.policy_versions == [7, 7, 7, 7, 8]
    assert sample.temperatures == [0.7] * 5
    assert sample.oldest_version == 7
    assert sample.routed_experts() is None


def test_multi_turn_extension_is_one_sample_with_environment_tokens_masked():
    episode = EpisodeTokens()
    # Turn 1: prompt [10, 11], completion [12, 13] (13 is the end of turn).
    episode.add_turn(turn([10, 11], [12, 13], versions=[3, 3], logprobs=[-1.0, -2.0], routed=rows(0, 4)))
    # Turn 2: the history plus the environment's answer [20, 21, 22], completion [30].
    # Its routed rows cover all 8 tokens; rows 3.. are new (row 3: the real row of token 13).
    prompt = [10, 11, 12, 13, 20, 21, 22]
    assert episode.add_turn(turn(prompt, [30], versions=[4], logprobs=[-3.0], temperature=0.5, routed=rows(100, 8)))
    [sample] = episode.samples
    assert sample.token_ids == [10, 11, 12, 13, 20, 21, 22, 30]
    assert sample.loss_mask == [False, False, True, True, False, False, False, True]
    assert sample.logprobs == [0.0, 0.0, -1.0, -2.0, 0.0, 0.0, 0.0, -3.0]
    assert sample.policy_versions == [3, 3, 3, 3, 4, 4, 4, 4]
    assert sample.temperatures == [1.0] * 4 + [0.5] * 4
    routed = sample.routed_experts()
    assert routed.shape == (8, LAYERS, TOP_K)
    # Rows 0-2 from turn 1's forward; row 3 (turn 1's last token, never forwarded then) and
    # the rest from turn 2.
    assert routed[:, 0, 0].tolist() == [0, 1, 2, 103, 104, 105, 106, 107]
    assert (sample.oldest_version, episode.oldest_version) == (3, 3)
    assert sample.num_loss_tokens == 3


def test_history_that_does_not_extend_starts_a_new_sample():
    episode = EpisodeTokens()
    episode.add_turn(turn([10, 11], [12, 13], versions=[3, 3]))
    # The environment re-rendered the model's answer differently (13 -> 14).
    assert not episode.add_turn(turn([10, 11, 12, 14, 20], [30, 31], versions=[5, 5]))
    assert len(episode.samples) == 2
    second = episode.samples[1]
    assert second.token_ids == [10, 11, 12, 14, 20, 30, 31]
    assert second.loss_mask == [False] * 5 + [True, True]
    assert episode.oldest_version == 3
    # A prompt equal to the sample (nothing appended) does not extend it either.
    assert not episode.samples[1].is_extended_by(second.token_ids)


def test_oldest_version_ignores_prompt_tokens():
    episode = EpisodeTokens()
    assert episode.oldest_version is None
    episode.add_turn(turn([1], [2, 3], versions=[6, 5]))
    assert episode.oldest_version == 5
