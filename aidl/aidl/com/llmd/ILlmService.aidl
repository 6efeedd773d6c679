package com.llmd;

import com.llmd.ILlmSession;
import com.llmd.ModelInfo;
import com.llmd.ServiceStatus;
import com.llmd.SessionOptions;

/**
 * llmd's entry point for apps: registered as "llmd" with the service manager (and on the
 * daemon's Unix socket). Errors are service-specific codes from ErrorCode. Administration is
 * a separate service, ILlmAdmin ("llmd.admin"), that the SELinux policy keeps apps from finding.
 */
interface ILlmService {
    /** Bumped when methods are added; a client checks getStatus().interfaceVersion. */
    const int VERSION = 2;

    ModelInfo[] listModels();
    ModelInfo getModelInfo(@utf8InCpp String modelId);
    ILlmSession openSession(@utf8InCpp String modelId, in SessionOptions options);
    ServiceStatus getStatus();
}
