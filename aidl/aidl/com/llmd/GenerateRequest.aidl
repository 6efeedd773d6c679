package com.llmd;

import com.llmd.ChatMessage;
import com.llmd.Priority;

/**
 * What to generate. Either `prompt` (raw text, continued as is) or `messages` (a conversation,
 * rendered with the model's chat template and appended to the session's context).
 */
@RustDerive(Clone=true, PartialEq=true)
parcelable GenerateRequest {
    @utf8InCpp String prompt;
    ChatMessage[] messages;
    /** 0 = greedy. */
    float temperature = 0.0f;
    /** 0 = no limit. */
    int topK = 40;
    float topP = 0.95f;
    float minP = 0.05f;
    float repetitionPenalty = 1.0f;
    long seed = 0;
    int maxTokens = 256;
    @utf8InCpp String[] stop;
    Priority priority = Priority.FOREGROUND;
    /**
     * Milliseconds from submission by which the request must have finished; 0 = no deadline.
     * A request still queued or running then ends with DEADLINE_EXCEEDED (since version 2).
     */
    long deadlineMs = 0;
}
