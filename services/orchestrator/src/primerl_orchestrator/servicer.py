"""primerl.orchestrator.v1.OrchestratorService: proto <-> domain translation only."""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Iterator

import grpc
from google.protobuf import json_format, struct_pb2

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.admission import Overloaded, caller_key
from primerl_common.errors import InvalidArgument
from primerl_common.server import ServiceDefinition
from primerl_orchestrator.environments import Task
from primerl_orchestrator.episodes import Episode
from primerl_orchestrator.eval_episodes import EvalEpisode
from primerl_orchestrator.prompt_images import ImageInput, ImageUri
from primerl_orchestrator.rendering import Message
from primerl_orchestrator.run import Run, RunState
from primerl_orchestrator.tool_calls import ToolCall, ToolSpec

__all__ = ["OrchestratorServicer"]

_STATES = {
    RunState.STARTING: orchestrator_pb2.RUN_STATE_STARTING,
    RunState.RUNNING: orchestrator_pb2.RUN_STATE_RUNNING,
    RunState.PAUSED: orchestrator_pb2.RUN_STATE_PAUSED,
    RunState.FINISHED: orchestrator_pb2.RUN_STATE_FINISHED,
    RunState.FAILED: orchestrator_pb2.RUN_STATE_FAILED,
}


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    def __init__(self, definition: ServiceDefinition, run: Run) -> None:
        self._definition = definition
        self._run = run
        # run.max_episodes_per_caller: each caller's episodes handed out, and those it waits for.
        self._episodes_of: dict[str, list[Episode | EvalEpisode]] = {}
        self._waiting_for: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def _episodes_for(
        self, context: grpc.aio.ServicerContext, num_episodes: int
    ) -> Iterator[list[Episode | EvalEpisode]]:
        """Admits a caller's request for `num_episodes` under run.max_episodes_per_caller; the
        episodes it gets are appended to the list yielded."""
        limit = self._run.config.run.max_episodes_per_caller
        caller = caller_key(context)
        held = [episode for episode in self._episodes_of.pop(caller, []) if not episode.state.ended]
        if held:
            self._episodes_of[caller] = held
        if limit is not None and len(held) + self._waiting_for[caller] + num_episodes > limit:
            raise Overloaded(
                f"{caller} holds {len(held)} unfinished episodes and waits for {self._waiting_for[caller]}; "
                f"{num_episodes} more would pass run.max_episodes_per_caller = {limit}: finish some first",
                config_field="run.max_episodes_per_caller",
                limit=limit,
                retry_after_s=1.0,
            )
        self._waiting_for[caller] += num_episodes
        got: list[Episode | EvalEpisode] = []
        try:
            yield got
        finally:
            self._waiting_for[caller] -= num_episodes
            if not self._waiting_for[caller]:
                del self._waiting_for[caller]
            if got:
                self._episodes_of.setdefault(caller, []).extend(got)

    async def GetServiceInfo(
        self, request: orchestrator_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetServiceInfoResponse:
        return orchestrator_pb2.GetServiceInfoResponse(info=self._definition.info())

    async def ListEnvironments(
        self, request: orchestrator_pb2.ListEnvironmentsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListEnvironmentsResponse:
        return orchestrator_pb2.ListEnvironmentsResponse(
            environments=[
                orchestrator_pb2.EnvironmentInfo(
                    name=env.name,
                    builtin=env.config.builtin,
                    group_size=env.config.group_size,
                    weight=env.config.weight,
                )
                for env in self._run.environments.values()
            ]
        )

    async def NextEpisode(
        self, request: orchestrator_pb2.NextEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.NextEpisodeResponse:
        with self._episodes_for(context, 1) as got:
            episode = await self._run.next_episode(request.environment)
            got.append(episode)
        return orchestrator_pb2.NextEpisodeResponse(episode=_episode_to_proto(episode))

    async def StartEpisode(
        self, request: orchestrator_pb2.StartEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.StartEpisodeResponse:
        task = Task(task_id=request.task.task_id, data=json_format.MessageToDict(request.task.data))
        num_episodes = request.num_episodes or self._run.environment(request.environment).config.group_size
        with self._episodes_for(context, num_episodes) as got:
            episodes = await self._run.start_episodes(request.environment, task, request.num_episodes)
            got.extend(episodes)
        return orchestrator_pb2.StartEpisodeResponse(episodes=[_episode_to_proto(e) for e in episodes])

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GenerateResponse:
        prompt = request.WhichOneof("prompt")
        if prompt is None:
            raise InvalidArgument("set messages or tokens", field="prompt")
        sampling = request.sampling if request.HasField("sampling") else None
        if prompt == "messages":
            result = await self._run.generate(
                request.episode_id,
                messages=[_message(m, index) for index, m in enumerate(request.messages.messages)],
                tools=[_tool(tool, index) for index, tool in enumerate(request.messages.tools)],
                sampling=sampling,
            )
        else:
            result = await self._run.generate(request.episode_id, token_ids=request.tokens.token_ids, sampling=sampling)
        return orchestrator_pb2.GenerateResponse(
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            turn=result.turn,
            truncated=result.truncated,
            first_policy_version=result.first_policy_version,
            last_policy_version=result.last_policy_version,
            tool_calls=[
                orchestrator_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
                for call in result.tool_calls
            ],
        )

    async def FinishEpisode(
        self, request: orchestrator_pb2.FinishEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.FinishEpisodeResponse:
        result = self._run.finish_episode(
            request.episode_id, reward=request.reward, metrics=dict(request.metrics), discard=request.discard
        )
        return orchestrator_pb2.FinishEpisodeResponse(
            group_complete=result.group_complete, num_samples=result.num_samples
        )

    async def GetRunStatus(
        self, request: orchestrator_pb2.GetRunStatusRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GetRunStatusResponse:
        status = self._run.status()
        return orchestrator_pb2.GetRunStatusResponse(
            state=_STATES[status.state],
            step=status.step,
            max_steps=status.max_steps,
            policy_version=status.policy_version,
            max_async_level=status.max_async_level,
            max_off_policy_steps=status.max_off_policy_steps,
            num_dropped_off_policy_total=status.dropped_off_policy_total,
            off_policy_steps_mean=status.off_policy_steps_mean,
            off_policy_steps_max=status.off_policy_steps_max,
            environments=[
                orchestrator_pb2.EnvironmentStats(
                    name=env.name,
                    num_episodes_started=env.episodes_started,
                    num_episodes_finished=env.episodes_finished,
                    num_episodes_running=env.episodes_running,
                    reward_mean=env.reward_mean,
                    reward_std=env.reward_std,
                    num_dropped_off_policy=env.dropped_off_policy,
                    num_errors=env.errors,
                )
                for env in status.environments
            ],
            error=status.error,
            groups=orchestrator_pb2.GroupCounts(
                finished=status.groups.finished,
                filtered_equal_rewards=status.groups.filtered_equal_rewards,
                incomplete=status.groups.incomplete,
                episodes_timed_out=status.groups.episodes_timed_out,
                batched=status.groups.batched,
            ),
        )

    async def PauseRun(
        self, request: orchestrator_pb2.PauseRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.PauseRunResponse:
        return orchestrator_pb2.PauseRunResponse(state=_STATES[self._run.pause()])

    async def ResumeRun(
        self, request: orchestrator_pb2.ResumeRunRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ResumeRunResponse:
        return orchestrator_pb2.ResumeRunResponse(state=_STATES[self._run.resume()])


def _episode_to_proto(episode: Episode | EvalEpisode) -> orchestrator_pb2.Episode:
    if isinstance(episode, EvalEpisode):
        task, group_id, group_size = episode.task, episode.group_id, episode.group_size
        evaluation = episode.play.evaluation
    else:
        task, group_id, group_size = episode.group.task, episode.group.group_id, len(episode.group.episodes)
        evaluation = ""
    data = struct_pb2.Struct()
    data.update(task.data)
    return orchestrator_pb2.Episode(
        episode_id=episode.episode_id,
        group_id=group_id,
        environment=episode.environment,
        task=orchestrator_pb2.Task(task_id=task.task_id, data=data),
        group_size=group_size,
        index_in_group=episode.index_in_group,
        policy_version=episode.start_version,
        evaluation=evaluation,
    )


def _message(message: orchestrator_pb2.ChatMessage, index: int) -> Message:
    field = f"messages.messages[{index}]"
    if message.parts and message.content:
        raise InvalidArgument("must be empty when `parts` holds the content", field=f"{field}.content")
    return Message(
        role=message.role,
        content=message.content,
        tool_calls=tuple(ToolCall(c.name, c.arguments, id=c.id) for c in message.tool_calls),
        tool_call_id=message.tool_call_id,
        parts=tuple(_part(part, f"{field}.parts[{number}]") for number, part in enumerate(message.parts)),
    )


def _part(part: orchestrator_pb2.ContentPart, field: str) -> str | ImageInput | ImageUri:
    """A part of a message's content; images are read and checked when the prompt is rendered."""
    kind = part.WhichOneof("part")
    if kind == "text":
        return part.text
    if kind != "image":
        raise InvalidArgument("set text or image", field=field)
    image = part.image
    if image.WhichOneof("source") == "data":
        return ImageInput(image.data, image.mime_type)
    if not image.uri:
        raise InvalidArgument("set data or uri", field=f"{field}.image")
    return ImageUri(image.uri, image.mime_type)


def _tool(tool: orchestrator_pb2.Tool, index: int) -> ToolSpec:
    field = f"messages.tools[{index}]"
    if not tool.name:
        raise InvalidArgument("a tool needs a name", field=f"{field}.name")
    parameters = None
    if tool.parameters_json:
        try:
            parameters = json.loads(tool.parameters_json)
        except ValueError as exc:
            raise InvalidArgument(f"not JSON: {exc}", field=f"{field}.parameters_json") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument("the JSON schema must be an object", field=f"{field}.parameters_json")
    return ToolSpec(tool.name, tool.description, parameters)
