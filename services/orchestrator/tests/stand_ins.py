"""Stand-ins for the orchestrator's peers (a trainer that takes batches, a router that answers
every turn) and an external environment's moves through the orchestrator API, for tests that run
a real orchestrator."""

from __future__ import annotations

from primerl.common.v1 import generation_pb2
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc


class StandInTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """An RL trainer that has completed no step (policy version 0 is the latest) and takes batches."""

    def __init__(self) -> None:
        self.pushed: list[int] = []

    async def GetBatchSpec(self, request, context):
        return trainer_pb2.GetBatchSpecResponse(
            seq_len=256, vocab_size=320, next_step=len(self.pushed) + 1, mode=trainer_pb2.TRAINING_MODE_RL
        )

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(mode=trainer_pb2.TRAINING_MODE_RL, step=0, published_policy_version=0)

    async def PushBatch(self, request_iterator, context):
        steps = [request.begin.step async for request in request_iterator if request.HasField("begin")]
        self.pushed += steps
        return trainer_pb2.PushBatchResponse(step=steps[0])


class StandInRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers every turn with the same two tokens, sampled by policy version 0."""

    def output(self, request: router_pb2.GenerateRequest) -> generation_pb2.GenerationOutput:
        return generation_pb2.GenerationOutput(
            token_ids=[65, 66],
            logprobs=[-0.1, -0.2],
            policy_versions=[0, 0],
            finished=True,
            finish_reason=generation_pb2.FINISH_REASON_STOP,
        )

    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(output=self.output(request))


async def start_group(stub: orchestrator_pb2_grpc.OrchestratorServiceStub, task_id: str) -> list[str]:
    request = orchestrator_pb2.StartEpisodeRequest(environment="guess", task=orchestrator_pb2.Task(task_id=task_id))
    return [episode.episode_id for episode in (await stub.StartEpisode(request, timeout=10)).episodes]


async def turn(stub: orchestrator_pb2_grpc.OrchestratorServiceStub, episode_id: str) -> None:
    messages = orchestrator_pb2.ChatMessages(messages=[orchestrator_pb2.ChatMessage(role="user", content="hi")])
    await stub.Generate(orchestrator_pb2.GenerateRequest(episode_id=episode_id, messages=messages), timeout=10)


async def finish(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub, episode_id: str, reward: float = 0.0, *, discard: bool = False
) -> orchestrator_pb2.FinishEpisodeResponse:
    request = orchestrator_pb2.FinishEpisodeRequest(episode_id=episode_id, reward=reward, discard=discard)
    return await stub.FinishEpisode(request, timeout=10)


async def play_group(stub: orchestrator_pb2_grpc.OrchestratorServiceStub, task_id: str, rewards: list[float]) -> None:
    for episode_id, reward in zip(await start_group(stub, task_id), rewards, strict=True):
        await turn(stub, episode_id)
        await finish(stub, episode_id, reward)
