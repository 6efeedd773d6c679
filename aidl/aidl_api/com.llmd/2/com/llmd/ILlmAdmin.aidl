package com.llmd;

/**
 * Administration of llmd, registered as "llmd.admin". Only the shell, system and the model
 * updater may find it (sepolicy/); the daemon also checks the caller's uid against its config.
 */
interface ILlmAdmin {
    /** Loads a model ahead of use. */
    void prefetch(@utf8InCpp String modelId);
    /** The daemon's state as text: models, sessions, queues, memory, config; never prompts. */
    @utf8InCpp String dumpState();
}
