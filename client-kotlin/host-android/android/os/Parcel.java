// Host stand-in for android.os.Parcel (JVM tests only): a little-endian byte buffer with the
// calls the AIDL-generated stubs make. Binder objects travel in a side table (there is no
// kernel here), everything else as bytes, so proxies and stubs really serialize.
package android.os;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.List;

public final class Parcel {
    private static final int EX_SERVICE_SPECIFIC = -8;
    private static final int EX_ILLEGAL_ARGUMENT = -3;
    private static final int EX_NULL_POINTER = -4;
    private static final int EX_ILLEGAL_STATE = -5;

    private ByteBuffer buf = ByteBuffer.allocate(256).order(ByteOrder.LITTLE_ENDIAN);
    private int size = 0;
    private final List<IBinder> binders = new ArrayList<>();

    public static Parcel obtain() { return new Parcel(); }
    public void recycle() {}

    public int dataPosition() { return buf.position(); }
    public int dataSize() { return size; }
    public void setDataPosition(int pos) { buf.position(pos); }

    private void ensure(int n) {
        if (buf.position() + n > buf.capacity()) {
            ByteBuffer bigger = ByteBuffer.allocate(Math.max(buf.capacity() * 2, buf.position() + n)).order(ByteOrder.LITTLE_ENDIAN);
            int pos = buf.position();
            buf.position(0);
            buf.limit(size);
            bigger.put(buf);
            bigger.position(pos);
            buf = bigger;
        }
        buf.limit(buf.capacity());
    }
    private void grew() { size = Math.max(size, buf.position()); }
    private void need(int n) {
        if (buf.position() + n > size) throw new IllegalStateException("read past the end of the parcel");
    }

    public void writeInt(int v) { ensure(4); buf.putInt(v); grew(); }
    public int readInt() { need(4); return buf.getInt(); }
    public void writeLong(long v) { ensure(8); buf.putLong(v); grew(); }
    public long readLong() { need(8); return buf.getLong(); }
    public void writeFloat(float v) { ensure(4); buf.putFloat(v); grew(); }
    public float readFloat() { need(4); return buf.getFloat(); }
    public void writeBoolean(boolean v) { writeInt(v ? 1 : 0); }
    public boolean readBoolean() { return readInt() != 0; }

    /** UTF-16 with a length prefix (-1 for null), as Parcel.writeString does. */
    public void writeString(String s) {
        if (s == null) { writeInt(-1); return; }
        writeInt(s.length());
        ensure(2 * s.length() + 2);
        for (int i = 0; i < s.length(); i++) buf.putChar(s.charAt(i));
        buf.putChar('\0');
        grew();
    }
    public String readString() {
        int n = readInt();
        if (n < 0) return null;
        need(2 * n + 2);
        StringBuilder sb = new StringBuilder(n);
        for (int i = 0; i < n; i++) sb.append(buf.getChar());
        buf.getChar();
        return sb.toString();
    }

    public void writeInterfaceToken(String descriptor) { writeString(descriptor); }
    public void enforceInterface(String descriptor) {
        String got = readString();
        if (!descriptor.equals(got)) throw new SecurityException("interface " + got + " is not " + descriptor);
    }

    public void writeStrongBinder(IBinder b) {
        binders.add(b);
        writeInt(binders.size() - 1);
    }
    public IBinder readStrongBinder() { return binders.get(readInt()); }

    public void writeIntArray(int[] a) {
        if (a == null) { writeInt(-1); return; }
        writeInt(a.length);
        for (int v : a) writeInt(v);
    }
    public int[] createIntArray() {
        int n = readInt();
        if (n < 0) return null;
        int[] a = new int[n];
        for (int i = 0; i < n; i++) a[i] = readInt();
        return a;
    }
    public void writeStringArray(String[] a) {
        if (a == null) { writeInt(-1); return; }
        writeInt(a.length);
        for (String s : a) writeString(s);
    }
    public String[] createStringArray() {
        int n = readInt();
        if (n < 0) return null;
        String[] a = new String[n];
        for (int i = 0; i < n; i++) a[i] = readString();
        return a;
    }

    public <T extends Parcelable> void writeTypedArray(T[] a, int flags) {
        if (a == null) { writeInt(-1); return; }
        writeInt(a.length);
        for (T v : a) {
            if (v == null) { writeInt(0); } else { writeInt(1); v.writeToParcel(this, flags); }
        }
    }
    public <T> T[] createTypedArray(Parcelable.Creator<T> c) {
        int n = readInt();
        if (n < 0) return null;
        T[] a = c.newArray(n);
        for (int i = 0; i < n; i++) a[i] = readInt() != 0 ? c.createFromParcel(this) : null;
        return a;
    }

    public void writeNoException() { writeInt(0); }
    public void writeException(Exception e) {
        if (e instanceof ServiceSpecificException) {
            writeInt(EX_SERVICE_SPECIFIC);
            writeString(e.getMessage());
            writeInt(((ServiceSpecificException) e).errorCode);
        } else if (e instanceof IllegalArgumentException) {
            writeInt(EX_ILLEGAL_ARGUMENT); writeString(e.getMessage());
        } else if (e instanceof NullPointerException) {
            writeInt(EX_NULL_POINTER); writeString(e.getMessage());
        } else {
            writeInt(EX_ILLEGAL_STATE); writeString(String.valueOf(e));
        }
    }
    public void readException() {
        int code = readInt();
        if (code == 0) return;
        String msg = readString();
        switch (code) {
            case EX_SERVICE_SPECIFIC: throw new ServiceSpecificException(readInt(), msg);
            case EX_ILLEGAL_ARGUMENT: throw new IllegalArgumentException(msg);
            case EX_NULL_POINTER: throw new NullPointerException(msg);
            default: throw new IllegalStateException(msg);
        }
    }
}
