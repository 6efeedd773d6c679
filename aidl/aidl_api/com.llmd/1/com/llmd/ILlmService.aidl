package com.llmd;

import com.llmd.ILlmSession;
import com.llmd.ModelInfo;
import com.llmd.ServiceStatus;
import com.llmd.SessionOptions;

/**
 * llmd's entry point: registered as "llmd" with the service manager, or served as the root
 * object of the daemon's Unix socket. Errors are service-specific codes from ErrorCode.
 */
interface ILlmService {
    /** Bumped when methods are added; a client checks getStatus().interfaceVersion. */
    const int VERSION = 1;

    ModelInfo[] listModels();
    ModelInfo getModelInfo(@utf8InCpp String modelId);
    ILlmSession openSession(@utf8InCpp String modelId, in SessionOptions options);
    ServiceStatus getStatus();
    /** Loads a model ahead of use (admin). */
    void prefetch(@utf8InCpp String modelId);
    /** The daemon's state as text: models, sessions, queues, memory, config; never prompts (admin). */
    @utf8InCpp String dumpState();
}
